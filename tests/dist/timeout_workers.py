"""Rank functions for the collective-timeout test: one rank stalls before a gradient all-reduce."""

from __future__ import annotations

import json
import time
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from plait.core.comm import Work
from plait.core.engine import Engine
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.plugins.resilience import timeouts
from tests.dist.checkpoint_workers import engine_batches, engine_config

REPORTED_KEY = "test/timeout_reported"
PUBLISHED_KEY = "test/stalled_rank_published"
WAIT = timedelta(seconds=60)


class Stalled(Exception):
    """Raised on the stalling rank once its peer has reported the timeout."""


class StallBeforeGradientAllReduce:
    """On the stalling rank, the first gradient all-reduce of step `step` is never entered: the
    rank waits (outside the op) until its peer has reported the timeout, then gives up.

    Neither side races the reporter's once-a-second publisher: the stalling rank first waits
    until its published progress shows the last collective it entered, and only then does its
    peer enter the op and start its timeout clock."""

    def __init__(self, *, active: bool, step: int) -> None:
        self.active = active
        self.step = step
        self.engine: Engine | None = None
        self.stalled_seq: int | None = None
        self.entered = False

    # tryfirst: the outermost wrapper, so the op is stopped before the reporter records it.
    @hookimpl(wrapper=True, tryfirst=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Work, Work]:
        if (
            not self.entered
            and self.engine is not None
            and self.engine.global_step == self.step
            and request.op == "all_reduce"
            and request.purpose == "grad_bucket"
        ):
            self.entered = True
            store = dist.distributed_c10d._get_default_store()
            if self.active:
                self.stalled_seq = request.seq
                _wait_until_published(self.engine, store)
                store.set(PUBLISHED_KEY, "1")
                store.wait([REPORTED_KEY], WAIT)
                raise Stalled(f"stalled before {request.op} seq {request.seq}")
            store.wait([PUBLISHED_KEY], WAIT)
        return (yield)


def _wait_until_published(engine: Engine, store: Any) -> None:
    """Until this rank's progress in the store is what its reporter holds now (the publisher
    thread writes it within a second or so)."""
    reporter = engine.plugins.manager.get_plugin("collective_timeouts")
    expected = {timeouts.group_label(key): e.count for key, e in reporter._entered.items()}
    key = f"{timeouts.STORE_PREFIX}/rank{dist.get_rank()}"
    deadline = time.monotonic() + WAIT.total_seconds()
    while True:
        published = json.loads(store.get(key)) if store.check([key]) else {}
        if {label: entry[0] for label, entry in published.items()} == expected:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"progress {expected} never published (store has {published})")
        time.sleep(0.05)


def stall_one_rank(
    rank: int, world_size: int, stall_rank: int, stall_step: int, timeout_seconds: float
) -> dict[str, Any]:
    del world_size
    stall = StallBeforeGradientAllReduce(active=rank == stall_rank, step=stall_step)
    # The reporter is a built-in plugin: every engine has one.
    plugins = Plugins.create(autoload=False, extra=[("stall", stall)])
    assert isinstance(
        plugins.manager.get_plugin("collective_timeouts"), timeouts.CollectiveTimeoutReporter
    )
    config = engine_config()
    config["train"] = {**config["train"], "collective_timeout_seconds": timeout_seconds}
    engine = Engine(config=config, plugins=plugins)
    stall.engine = engine
    # The test harness initialised the default group before the engine existed (the engine
    # applies the timeout to groups it initialises itself): apply the configured timeout to it,
    # which the dp group of a one-axis mesh is.
    dist.distributed_c10d._set_pg_timeout(
        timedelta(seconds=engine.config.train.collective_timeout_seconds)
    )
    batches = engine_batches(engine)
    result: dict[str, Any] = {"rank": rank, "error": None, "stalled_seq": None}
    try:
        for _ in range(stall_step + 1):
            engine.train_step(batches.next_batch())
    except timeouts.CollectiveTimeoutError as exc:
        result.update(
            error=str(exc),
            op=exc.op,
            group=exc.group,
            seq=exc.seq,
            missing_ranks=exc.missing_ranks,
        )
        dist.distributed_c10d._get_default_store().set(REPORTED_KEY, "1")
    except Exception as exc:
        if stall.stalled_seq is None:
            raise
        result["stalled_seq"] = stall.stalled_seq
        result["stall_error"] = f"{type(exc).__name__}: {exc}"
    return result
