"""ZeRO++'s codecs in one process: a block-wise round trip of any length stays within half a
step of each block's scale (and int4 keeps signs), the encoded size is the formula's, and a
configuration in which a codec would encode nothing, or a stage would ignore a `[zero]` knob,
is refused by name."""

from __future__ import annotations

import pytest
import torch

from plait.core.engine import Engine
from plait.core.errors import ConfigError
from plait.plugins.collectives.codecs import codec_named
from plait.plugins.collectives.step_bytes import encoded_bytes

CONFIG = {
    "telemetry": {"enabled": False},
    "train": {"device": "cpu", "global_batch_size": 1},
    "model": {"name": "llama", "size": "tiny"},
}


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("numel", [1, 63, 64, 1001])
def test_round_trip_is_within_half_a_step_at_any_length(name: str, numel: int) -> None:
    codec = codec_named(name, 64)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    x[: min(numel, 64)] *= 1e-3  # a block far smaller than the others keeps its own scale
    payload, scales = codec.encode(x)
    assert payload.dtype == torch.uint8 and scales.dtype == torch.float32
    bits = 8 // codec.per_byte
    assert payload.numel() + 4 * scales.numel() == encoded_bytes(numel, bits=bits, block=64)
    decoded = codec.decode(payload, scales, numel)
    bound = codec.error_bound(x)
    assert bool(((decoded - x).abs() <= bound * (1 + 1e-5)).all())
    assert bool((torch.sign(decoded) * torch.sign(x) >= 0).all())  # no sign flips (int4)
    zeros = codec.decode(*codec.encode(torch.zeros(numel)), numel)
    assert bool((zeros == 0).all())


@pytest.mark.parametrize(
    ("strategy", "zero", "message"),
    [
        ("zero1", {"quantize_gradients": "int8"}, "applies to zero2 and zero3, not zero1"),
        ("zero2", {"quantize_weights": "int8"}, "applies to zero3, not zero2"),
        ("zero3", {"quantize_weights": "int8"}, "set it to 'hierarchical'"),
    ],
)
def test_a_codec_that_would_encode_nothing_is_refused(
    strategy: str, zero: dict[str, str], message: str
) -> None:
    config = {**CONFIG, "parallel": {"dp_strategy": strategy}, "zero": zero}
    with pytest.raises(ConfigError, match=rf"zero.quantize_\w+ = 'int8' .*{message}"):
        Engine(config=config)


def test_secondary_shards_without_nodes_of_several_ranks_are_refused() -> None:
    config = {**CONFIG, "parallel": {"dp_strategy": "zero3"}, "zero": {"secondary_shard": "node"}}
    with pytest.raises(ConfigError, match=r'zero.secondary_shard = "node": .* needs several nodes'):
        Engine(config=config)


def test_the_banner_names_the_zero_plus_plus_knobs_that_are_on() -> None:
    from plait.training.banner import _with_options

    zero = {"shard_optimizer_across_replicas": False, "secondary_shard": "node"}
    resolved = {"zero3": {**zero, "quantize_weights": "int8", "quantize_gradients": "int4"}}
    assert _with_options("zero3", resolved) == "zero3 (hpZ per node, qwZ int8, qgZ int4)"
    resolved = {"zero1": {"shard_optimizer_across_replicas": True, "quantize_weights": "none"}}
    assert _with_options("zero1", resolved) == "zero1 (optimizer across replicas)"


@pytest.mark.parametrize(
    ("strategy", "zero", "message"),
    [
        ("ddp", {"quantize_gradients": "int8"}, "applies to zero2 and zero3, not parallel"),
        ("ddp", {"quantize_weights": "int8"}, "applies to zero3, not parallel"),
        ("ddp", {"secondary_shard": "node"}, "applies to zero3, not parallel"),
        ("ddp", {"shard_optimizer_across_replicas": True}, "applies to zero1 and zero2, not"),
        ("zero1", {"secondary_shard": "node"}, "applies to zero3, not parallel"),
        ("zero2", {"secondary_shard": "node"}, "applies to zero3, not parallel"),
    ],
)
def test_a_zero_knob_the_strategy_would_ignore_is_refused(
    strategy: str, zero: dict[str, object], message: str
) -> None:
    config = {**CONFIG, "parallel": {"dp_strategy": strategy}, "zero": zero}
    field = next(iter(zero))
    with pytest.raises(ConfigError, match=rf"zero.{field} = .* {message}"):
        Engine(config=config)
    # the defaults, named, are no request: a DDP config may carry a [zero] section
    defaults = {"secondary_shard": "none", "quantize_weights": "none", "quantize_gradients": "none"}
    Engine(config={**CONFIG, "parallel": {"dp_strategy": "ddp"}, "zero": defaults}).close()
