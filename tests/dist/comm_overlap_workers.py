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
from torch import nn

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


# How long one side of the gate waits for the other. Both events are set by the code under test
# as soon as it runs, so a healthy run never waits long; only broken overlap reaches the limit.
GATE_TIMEOUT_SECONDS = 30.0


class OverlapGate:
    """Proves, with events the code under test sets, that an algorithm reduces the first
    gradient bucket while backward is still running.

    Backward cannot finish until the algorithm's first gradient sub-op has started: a gate placed
    on the embedding's output (the last step of backward before the embedding's own gradient)
    blocks the training thread until that sub-op enters the communicate hook. The sub-op in turn
    is held until backward has passed the gate, so the training thread must go on without
    waiting for bucket 0's reduction. No outcome depends on which thread the OS runs first:

    - overlap works: the sub-op starts on the algorithm's worker while the gate waits for it;
    - buckets reduced only after backward (DDP deferring its launches): bucket 0 is not issued
      when the gate runs (`first_issued_in_backward` is False);
    - an algorithm that starts its work only when waited on: the gate times out;
    - one that reduces inside the hook: its sub-op runs on the training thread;
    - a training thread that waits for bucket 0 during backward: the held sub-op times out.
    """

    def __init__(self, algorithm: str) -> None:
        self.prefix = f"{algorithm}/{GRAD_BUCKET}"
        self.armed = False  # watching this step
        self.first_issued = threading.Event()  # DDP issued bucket 0
        self.first_sub_op_started = threading.Event()
        self.backward_passed_gate = threading.Event()
        self.first_issued_in_backward: bool | None = None
        self.started_in_backward: bool | None = None
        self.on_training_thread = False
        self.held_timed_out = False

    def arm(self, armed: bool) -> None:
        self.armed = armed

    def install(self, embedding: nn.Module) -> None:
        """Put the gate on `embedding`'s output (a forward hook: the model is unchanged)."""
        embedding.register_forward_hook(self._on_embedding_output)

    def _on_embedding_output(self, _module: nn.Module, _inputs: Any, output: Any) -> Any:
        return _BackwardGate.apply(output, self) if self.armed else output

    def wait_in_backward(self) -> None:
        """Called by the gate's backward, on the training thread."""
        self.first_issued_in_backward = self.first_issued.is_set()
        if self.first_issued_in_backward:
            self.started_in_backward = self.first_sub_op_started.wait(GATE_TIMEOUT_SECONDS)
        else:  # nothing was handed to the algorithm yet: it cannot have started
            self.started_in_backward = False
        self.backward_passed_gate.set()

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Any, Any]:
        if self.armed:
            if request.purpose == GRAD_BUCKET and request.attributes.get("bucket_index") == 0:
                self.first_issued.set()
            elif request.purpose.startswith(self.prefix) and not self.first_sub_op_started.is_set():
                self.first_sub_op_started.set()  # only the first sub-op of the step is held
                if threading.current_thread() is threading.main_thread():
                    self.on_training_thread = True
                else:
                    passed = self.backward_passed_gate.wait(GATE_TIMEOUT_SECONDS)
                    self.held_timed_out = not passed
        return (yield)


class _BackwardGate(torch.autograd.Function):
    """Identity forward; its backward holds the training thread at the gate."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, gate: OverlapGate) -> torch.Tensor:
        ctx.gate = gate
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.gate.wait_in_backward()
        return grad, None


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
    model = OddLM()
    if gate:
        extra.append(("overlap_gate", overlap_gate))
        overlap_gate.install(model.embed)
    plugins = Plugins.create(autoload=False, extra=extra)
    config = _config(strategy, case, share, reduction)
    engine = plait.initialize(model, config=config, plugins=plugins)
    buckets = len(engine.runtimes[0].buckets) if strategy == "ddp" else 0
    losses = []
    for step, (inputs, targets) in enumerate(global_batches(STEPS, GLOBAL_BATCH)):
        overlap_gate.arm(gate and step == 0)
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
        "buckets": buckets,
        "first_issued_in_backward": overlap_gate.first_issued_in_backward,
        "started_in_backward": overlap_gate.started_in_backward,
        "on_training_thread": overlap_gate.on_training_thread,
        "held_timed_out": overlap_gate.held_timed_out,
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
