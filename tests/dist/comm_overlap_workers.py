"""Rank functions for the comm-algorithm overlap and ZeRO reduce-scatter tests.

One spawn per world size runs every case in sequence, each with its own engine.
"""

from __future__ import annotations

import math
import threading
from collections import Counter
from collections.abc import Generator
from typing import Any

import torch

import plait
from plait.core.comm_algorithms import GRAD_BUCKET, is_sub_op
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from tests.dist.zero_workers import GLOBAL_BATCH, SEQ, OddLM, global_batches

STEPS = 3
# Every algorithm, with a table that makes it do real work on this tiny model.
ALGORITHMS: dict[str, dict[str, Any]] = {
    "ring": {},
    "tree": {"small_message_bytes": 0},
    "fp16": {},
    "bf16": {},
    "powersgd": {"rank": 1},
    "topk": {"ratio": 0.1},
    "param_server": {"mode": "sync"},
    "param_server_async": {"mode": "async", "staleness": 1},
}


def algorithm_of(case: str) -> str:
    return "param_server" if case.startswith("param_server") else case


class OverlapGate:
    """Holds the algorithm's first sub-op until the data-parallel runtime issues the last
    bucket, and records whether the algorithm's work had started before that.

    An algorithm that completes a bucket inside the hook runs its sub-ops on the training
    thread (recorded, never held); one that starts only when waited on starts after the last
    bucket. Either way the test fails.
    """

    def __init__(self, algorithm: str) -> None:
        self.prefix = f"{algorithm}/"
        self.last_bucket = -1
        self.last_issued = threading.Event()
        self.armed = False  # watching this step
        self.holding = False  # the next sub-op is still to be held
        self.first_issued_before_last: bool | None = None
        self.started_before_last: bool | None = None
        self.on_training_thread = False
        self.timed_out = False

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Any, Any]:
        if self.armed and request.purpose == GRAD_BUCKET:
            index = request.attributes.get("bucket_index")
            if index == 0:
                self.first_issued_before_last = not self.last_issued.is_set()
            if index == self.last_bucket:
                self.last_issued.set()
        elif self.armed and self.holding and request.purpose.startswith(self.prefix):
            self.holding = False  # only the first sub-op of the step is held
            self.started_before_last = not self.last_issued.is_set()
            if threading.current_thread() is threading.main_thread():
                self.on_training_thread = True
            else:
                self.timed_out = not self.last_issued.wait(timeout=10)
        return (yield)


class OpCounter:
    """Counts requests by (op, purpose) and the algorithm sub-ops."""

    def __init__(self) -> None:
        self.ops: Counter[tuple[str, str]] = Counter()
        self.sub_ops = 0
        self.lock = threading.Lock()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Any, Any]:
        with self.lock:
            if is_sub_op(request.purpose):
                self.sub_ops += 1
            else:
                self.ops[(request.op, request.purpose)] += 1
        return (yield)


def _config(strategy: str, case: str, micro_batch: int, reduction: str) -> dict[str, Any]:
    algorithm = algorithm_of(case)
    comm: dict[str, Any] = {"algorithm": algorithm}
    if case != "torch":
        comm[algorithm] = ALGORITHMS[case]
    config: dict[str, Any] = {
        "train": {"micro_batch_size": micro_batch, "max_grad_norm": 0.0, "seed": 0},
        "optimizer": {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.0, "min_lr_ratio": 1.0},
        "parallel": {"dp_strategy": strategy},
        "telemetry": {"enabled": False},
        "data": {"seq_len": SEQ},
        "comm": comm,
    }
    if strategy == "ddp":
        config["ddp"] = {"bucket_mb": 0.004}
    else:
        config["zero"] = {
            "bucket_mb": 0.004,
            "unit": ["Block"],
            "gradient_reduction": reduction,
        }
    return config


def train(
    rank: int,
    world_size: int,
    *,
    strategy: str,
    case: str,
    reduction: str = "auto",
    gate: bool = False,
) -> dict[str, Any]:
    torch.manual_seed(0)
    share = GLOBAL_BATCH // world_size
    overlap_gate = OverlapGate(algorithm_of(case))
    counter = OpCounter()
    extra: list[tuple[str, object]] = [("op_counter", counter)]
    if gate:
        extra.append(("overlap_gate", overlap_gate))
    plugins = Plugins.create(autoload=False, extra=extra)
    config = _config(strategy, case, share, reduction)
    engine = plait.initialize(OddLM(), config=config, plugins=plugins)
    if gate:
        overlap_gate.last_bucket = len(engine.runtimes[0].buckets) - 1
    losses = []
    for step, (inputs, targets) in enumerate(global_batches(STEPS, GLOBAL_BATCH)):
        overlap_gate.armed = overlap_gate.holding = gate and step == 0
        local = (
            inputs[rank * share : (rank + 1) * share],
            targets[rank * share : (rank + 1) * share],
        )
        losses.append(engine.train_step(local))
    engine.close()
    return {
        "losses": losses,
        "ops": dict(counter.ops),
        "sub_ops": counter.sub_ops,
        "buckets": overlap_gate.last_bucket + 1,
        "first_issued_before_last": overlap_gate.first_issued_before_last,
        "started_before_last": overlap_gate.started_before_last,
        "on_training_thread": overlap_gate.on_training_thread,
        "timed_out": overlap_gate.timed_out,
    }


def overlap_cases(rank: int, world_size: int) -> dict[str, Any]:
    """Every algorithm under DDP, with the gate on its first step."""
    return {
        case: train(rank, world_size, strategy="ddp", case=case, gate=True) for case in ALGORITHMS
    }


def reduce_scatter_cases(rank: int, world_size: int) -> dict[str, Any]:
    """ZeRO-2/3 on the forced reduce-scatter path: the backend's collective, then every
    algorithm on ZeRO-2 and the exact ones on ZeRO-3."""
    out: dict[str, Any] = {}
    for strategy in ("zero2", "zero3"):
        out[f"{strategy}/torch"] = train(
            rank, world_size, strategy=strategy, case="torch", reduction="reduce_scatter"
        )
    for case in ALGORITHMS:
        out[f"zero2/{case}"] = train(
            rank, world_size, strategy="zero2", case=case, reduction="reduce_scatter"
        )
    for case in ("ring", "tree"):
        out[f"zero3/{case}"] = train(
            rank, world_size, strategy="zero3", case=case, reduction="reduce_scatter"
        )
    return out


def single_process(rank: int, world_size: int) -> list[float]:
    return train(rank, world_size, strategy="ddp", case="torch")["losses"]


def finite(values: list[float]) -> bool:
    return all(math.isfinite(v) for v in values)
