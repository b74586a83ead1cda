"""`shardproof verify --hf CONFIG.json [--tp-plan PLAN.json]`: transformers' own TP from a config file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", minversion="5", reason="needs the hf extra: pip install 'shardproof[hf]'")

from shardproof.cli import main  # noqa: E402

LLAMA = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}


def _file(tmp_path: Path, name: str, content: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(content))
    return str(path)


def test_a_case_file_or_a_config_not_both_nor_neither(tmp_path: Path, capsys) -> None:
    for argv in (["verify"], ["verify", "case.py", "--hf", "config.json"], ["verify", "case.py", "--tp-plan", "p.json"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
    assert "--tp-plan goes with --hf" in capsys.readouterr().err


def test_an_unusable_config_or_plan_says_what_is_wrong(tmp_path: Path, capsys) -> None:
    assert main(["verify", "--hf", str(tmp_path / "missing.json"), "--quiet"]) == 2
    assert "config file not found" in capsys.readouterr().err
    assert main(["verify", "--hf", _file(tmp_path, "c.json", {"hidden_size": 8}), "--quiet"]) == 2
    assert "model_type" in capsys.readouterr().err
    plan = _file(tmp_path, "plan.json", {"layers.*.mlp.no_such_proj": "colwise"})
    assert main(["verify", "--hf", _file(tmp_path, "llama.json", LLAMA), "--tp-plan", plan, "--quiet"]) == 2
    assert "no_such_proj" in capsys.readouterr().err
