"""Interchangeability keys: equal exactly when two calls must record the same ops."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from shardproof.partition.fingerprint import call_key, module_key, value_key


@dataclass(frozen=True)
class Config:
    width: int
    eps: float


class Layer(nn.Module):
    def __init__(self, config: Config, scale: float = 1.0) -> None:
        super().__init__()
        self.config = config
        self.scale = scale
        self.proj = nn.Linear(config.width, config.width, bias=False).requires_grad_(False)

    def forward(self, x: torch.Tensor, gain: float = 1.0) -> torch.Tensor:
        return self.proj(x) * self.scale * gain


def test_plain_data_is_compared_by_value_and_objects_by_identity() -> None:
    assert value_key(Config(4, 1e-5)) == value_key(Config(4, 1e-5))
    assert value_key(Config(4, 1e-5)) != value_key(Config(4, 1e-6))
    assert value_key({"a": (1, [2.0])}) == value_key({"a": (1, [2.0])})
    assert value_key(object()) != value_key(object())
    assert value_key(1) != value_key(1.0) != value_key(True)


def test_twin_layers_share_a_key_and_a_different_attribute_or_config_breaks_it() -> None:
    twins = [Layer(Config(4, 1e-5)), Layer(Config(4, 1e-5))]
    assert module_key(twins[0]) == module_key(twins[1])
    assert module_key(Layer(Config(4, 1e-5), scale=2.0)) != module_key(twins[0])
    assert module_key(Layer(Config(4, 1e-6))) != module_key(twins[0])
    twins[1].train(False)
    assert module_key(twins[0]) != module_key(twins[1])


def test_modules_with_hooks_have_no_key() -> None:
    layer = Layer(Config(4, 1e-5))
    layer.proj.register_forward_hook(lambda module, args, out: out)
    assert module_key(layer) is None
    assert call_key(layer, (torch.randn(2, 4),), {}) is None


def test_call_key_covers_shapes_non_tensor_arguments_and_aliasing() -> None:
    layer = Layer(Config(4, 1e-5))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    key, flat = call_key(layer, (x,), {})
    assert [t.shape for t in flat] == [(2, 4), (4, 4)], "arguments first, then the module's state"
    assert call_key(layer, (y,), {})[0] == key, "other values, same metadata"
    assert call_key(layer, (torch.randn(3, 4),), {})[0] != key
    assert call_key(layer, (x.t().contiguous().t(),), {})[0] != key, "strides differ"
    assert call_key(layer, (x,), {"gain": 2.0})[0] != key
    assert call_key(layer, (x, 2.0), {})[0] != call_key(layer, (x,), {"gain": 2.0})[0]
    with torch.no_grad():
        assert call_key(layer, (x,), {})[0] != key, "grad mode is part of the key"


def test_call_key_sees_which_tensors_are_the_same_object() -> None:
    class Pair(nn.Module):
        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return a + b

    x, y = torch.randn(3), torch.randn(3)
    assert call_key(Pair(), (x, x), {})[0] != call_key(Pair(), (x, y), {})[0]


class Marked(torch.Tensor):
    """A tensor subclass: its own dispatch could record anything."""


def test_tensor_subclasses_have_no_key_and_requiring_grad_is_part_of_it() -> None:
    layer = Layer(Config(4, 1e-5))
    assert call_key(layer, (torch.randn(2, 4).as_subclass(Marked),), {}) is None
    key = call_key(layer, (torch.randn(2, 4),), {})[0]
    assert call_key(layer, (torch.randn(2, 4, requires_grad=True),), {})[0] != key


@dataclass
class _Groups:
    """Like Megatron's ProcessGroupCollection: fields declared init=False, set only when given."""

    tp: int = field(init=False)
    pp: int = field(init=False)


def test_a_dataclass_field_never_set_is_part_of_its_key() -> None:
    some, other = _Groups(), _Groups()
    some.tp = other.tp = 2
    assert value_key(some) == value_key(other)
    other.pp = 1
    assert value_key(some) != value_key(other)


def _installed_forward(module: nn.Linear, gain: float) -> None:
    """A framework's instance-level forward, a closure over its module (as transformers' TP plans install)."""
    original = module.forward

    def scaled(x: torch.Tensor) -> torch.Tensor:
        return original(x) * gain

    module.forward = scaled


def test_instance_forwards_are_keyed_by_code_and_what_they_close_over() -> None:
    twins = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    for linear, gain in zip(twins, (2.0, 2.0, 3.0)):
        _installed_forward(linear, gain)
    assert module_key(twins[0]) == module_key(twins[1])
    assert module_key(twins[0]) != module_key(twins[2]), "a value closed over differs"
    plain = nn.Linear(4, 4)
    assert module_key(plain) != module_key(twins[0])


def test_a_closure_over_its_own_mutable_state_is_keyed_by_that_state() -> None:
    def install(module: nn.Linear) -> None:
        hooked: dict[str, torch.Tensor] = {}
        original = module.forward

        def recording(x: torch.Tensor) -> torch.Tensor:
            hooked.setdefault("weight", module.weight)
            return original(x)

        module.forward = recording

    twins = [nn.Linear(4, 4), nn.Linear(4, 4)]
    for linear in twins:
        install(linear)
    assert module_key(twins[0]) != module_key(twins[1]), "each closes over a dict of its own"


def test_dtensors_are_keyed_by_placements_and_metadata_and_read_locally() -> None:
    from torch.distributed.tensor import DTensor, Replicate, Shard, init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch.distributed.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        layer = Layer(Config(4, 1e-5))
        x = torch.randn(2, 4)

        def held(*placements: object) -> DTensor:
            return DTensor.from_local(torch.randn(2, 4), mesh, list(placements), run_check=False)

        layer.proj.weight = nn.Parameter(held(Shard(0)), requires_grad=False)
        assert call_key(layer, (x,), {}) is None, "subclasses have no key unless distributed"
        key, flat = call_key(layer, (x,), {}, distributed=True)
        assert type(flat[1]) is torch.Tensor and flat[1] is layer.proj.weight._local_tensor
        layer.proj.weight = nn.Parameter(held(Shard(0)), requires_grad=False)
        assert call_key(layer, (x,), {}, distributed=True)[0] == key, "other values, same placements"
        layer.proj.weight = nn.Parameter(held(Replicate()), requires_grad=False)
        assert call_key(layer, (x,), {}, distributed=True)[0] != key
    finally:
        torch.distributed.destroy_process_group()


def test_tensors_with_hooks_have_no_key() -> None:
    layer = Layer(Config(4, 1e-5))
    layer.proj.weight.requires_grad_(True).register_post_accumulate_grad_hook(lambda p: None)
    assert call_key(layer, (torch.randn(2, 4),), {}) is None
