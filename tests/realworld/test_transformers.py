"""Hugging Face transformers' own tensor parallelism (its TP plans, its load-time slicing) on tiny
configs of the architectures whose config carries a `base_model_tp_plan`, with transformers'
defaults (sdpa attention, a bare `model(input_ids)`, tied embeddings where the config ties them,
the default MoE experts)."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", minversion="5", reason="needs the hf extra: pip install 'shardproof[hf]'")

from shardproof import verify  # noqa: E402
from shardproof.integrations.transformers import tiny_config, transformers_case  # noqa: E402
from shardproof.oracle import run_numeric  # noqa: E402

ARCHITECTURES = [
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere", "granite",
    "starcoder2", "gpt_neox", "mixtral", "qwen3_moe", "deepseek_v3",
]
RUNS = [(mode, n) for mode, sizes in (("forward", (2, 4, 8)), ("train", (2, 4))) for n in sizes]


@pytest.mark.parametrize("mode, world_size", RUNS, ids=[f"{mode}-{n}" for mode, n in RUNS])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_transformers_tp_computes_the_reference(architecture: str, mode: str, world_size: int) -> None:
    case = transformers_case(tiny_config(architecture), world_size=world_size, train=mode == "train")
    numbers = run_numeric(case, world_size, mode=mode)
    assert numbers.agree, numbers.detail


@pytest.mark.slow
@pytest.mark.parametrize("mode, world_size", RUNS, ids=[f"{mode}-{n}" for mode, n in RUNS])
@pytest.mark.parametrize("architecture", ARCHITECTURES)
def test_transformers_tp_is_proven(architecture: str, mode: str, world_size: int) -> None:
    """Proven equivalent with transformers' defaults (the test above shows the numbers agree)."""
    case = transformers_case(tiny_config(architecture), world_size=world_size, train=mode == "train")
    report = verify(case, world_size=world_size, train=mode == "train", backend="none")
    assert report.verdict == "equivalent", report.diagnosis or report.unknown


def test_an_all_ones_attention_mask_is_an_input() -> None:
    case = transformers_case(tiny_config("llama"), world_size=2, attention_mask=True)
    assert len(case.inputs()) == 2
    assert run_numeric(case, 2).agree
