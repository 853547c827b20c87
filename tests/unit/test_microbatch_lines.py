"""The micro-batch line `plait train` prints in its banner and in `--dry-run`, and the dry run's
refusal of a batch that cannot be split, before anything is launched."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from plait.core.config import load_config
from plait.core.errors import ConfigError
from plait.core.plugins import Plugins
from plait.tools.dry_run import print_dry_run
from plait.training.banner import microbatch_line

TINY = {"model": {"name": "llama", "size": "tiny"}, "telemetry": {"enabled": False}}


def dry_run(world_size: int, **sections: dict) -> str:
    config = load_config({**TINY, **sections})
    out = io.StringIO()
    console = Console(file=out, width=400)
    plugins = Plugins.create(autoload=False)
    print_dry_run(config, plugins, world_size=world_size, per_node=world_size, console=console)
    return out.getvalue()


def test_the_line_says_who_chose_the_micro_batches() -> None:
    chosen = microbatch_line(rows=8, micro_batch_size=2, configured=None, schedule="1f1b", pp=2)
    assert chosen.startswith("micro-batches: 4 of 2 rows per rank per step")
    assert "train.micro_batch_size unset: chosen for schedule 1f1b with pp=2" in chosen
    named = microbatch_line(rows=8, micro_batch_size=1, configured=1, schedule="1f1b", pp=2)
    assert named == "micro-batches: 8 of 1 row per rank per step (train.micro_batch_size = 1)"
    whole = microbatch_line(rows=8, micro_batch_size=8, configured=None, schedule="x", pp=1)
    assert whole.startswith("micro-batches: 1 of 8 rows per rank per step")
    assert "the whole batch" in whole


def test_dry_run_prints_the_count_chosen_for_pp_alone() -> None:
    out = dry_run(2, parallel={"pp": 2}, train={"global_batch_size": 8})
    assert (
        "micro-batches: 4 of 2 rows per rank per step (train.micro_batch_size unset: chosen "
        "for schedule 1f1b with pp=2" in out
    )


def test_dry_run_counts_rows_per_data_parallel_rank() -> None:
    out = dry_run(4, parallel={"pp": 2}, train={"global_batch_size": 8})  # dp = 2: 4 rows
    assert "micro-batches: 4 of 1 row per rank per step" in out


def test_dry_run_refuses_a_batch_the_schedule_cannot_split() -> None:
    with pytest.raises(ConfigError) as refused:
        dry_run(2, parallel={"pp": 2}, train={"global_batch_size": 1})
    message = str(refused.value)
    assert "train.micro_batch_size is unset" in message
    assert "batch of 1 row" in message and "needs at least 2 micro-batches" in message
