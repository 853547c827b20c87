"""`parallel.dp_shard` is a ZeRO setting: a dp strategy that does not shard refuses it by name
rather than ignoring it."""

from __future__ import annotations

import pytest

from plait.core.engine import Engine
from plait.core.errors import ConfigError

CONFIG = {
    "telemetry": {"enabled": False},
    "train": {"device": "cpu", "global_batch_size": 1},
    "model": {"name": "llama", "size": "tiny"},
}


def test_dp_shard_under_ddp_is_refused_by_name() -> None:
    config = {**CONFIG, "parallel": {"dp_strategy": "ddp", "dp_shard": 1}}
    with pytest.raises(ConfigError, match=r"parallel.dp_shard = 1 .* dp strategy 'ddp'"):
        Engine(config=config)


def test_dp_shard_under_zero3_is_taken() -> None:
    engine = Engine(config={**CONFIG, "parallel": {"dp_strategy": "zero3", "dp_shard": 1}})
    assert engine.mesh.data_parallel_split


@pytest.mark.parametrize(("strategy", "dp_shard"), [("zero1", None), ("zero2", 1), ("zero3", 1)])
def test_optimizer_across_replicas_without_replicas_or_under_zero3_is_refused(
    strategy: str, dp_shard: int | None
) -> None:
    config = {
        **CONFIG,
        "parallel": {"dp_strategy": strategy, "dp_shard": dp_shard},
        "zero": {"shard_optimizer_across_replicas": True},
    }
    with pytest.raises(ConfigError, match=r"zero.shard_optimizer_across_replicas = true needs"):
        Engine(config=config)
