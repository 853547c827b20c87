"""Rank functions for the pipeline tests (module level, so spawned ranks can import them).

Every run trains the built-in Llama for a few steps with SGD that records the gradients it is
given (after clipping, so the global gradient norm is checked too), keyed by the full model's
parameter names; several configurations run one after another in one spawn, each with a fresh
engine on the already-initialised process group.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Generator
from typing import Any

import torch

from plait.core.comm import Work
from plait.core.engine import Engine
from plait.core.errors import PlaitError
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.plugins.ddp.buckets import BucketedAllReduce
from plait.plugins.pipeline.runtime import PipelineRuntime

SEQ, VOCAB = 16, 256
MODEL = dict(dim=32, n_layers=8, n_heads=2, n_kv_heads=1, multiple_of=16, max_seq_len=64)
LR = 0.05


class OpCounter:
    """Counts the communication ops of each purpose ("grad_bucket", "activation", …)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.recv_issued_ns: list[int] = []  # when each receive was posted

    @hookimpl(wrapper=True)
    def plait_communicate(self, request: CommRequest) -> Generator[None, Work, Work]:
        self.counts[request.purpose] += 1
        if request.op == "recv":
            self.recv_issued_ns.append(time.time_ns())
        return (yield)


def receives_posted_in_their_own_action(counter: OpCounter, spans: Any) -> int:
    """How many of the step's receives were posted by their own receive action, not ahead
    (inside the compute action before it)."""
    actions = [s for s in spans if s.name != "idle"]  # idle spans lie inside receive actions
    return sum(
        1
        for t in counter.recv_issued_ns
        for s in actions
        if s.name == "recv" and s.start_ns <= t <= s.end_ns
    )


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the (reduced, clipped) gradient of every parameter per step."""

    def __init__(self, params: Any, lr: float) -> None:
        super().__init__(list(params), lr=lr)
        self.seen: list[dict[int, torch.Tensor]] = []

    def step(self, closure: Any = None) -> Any:
        self.seen.append(
            {id(p): p.grad.detach().clone() for g in self.param_groups for p in g["params"]}
        )
        return super().step(closure)


def global_batches(steps: int, global_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=generator)
        batches.append((tokens[:, :-1], tokens[:, 1:]))
    return batches


def _plugins(counter: OpCounter) -> Plugins:
    plugins = Plugins.create(autoload=False, extra=[("op_counter", counter)])
    if ("tp", "megatron") not in plugins.strategies():
        # Until the tensor-parallel plugin is in the built-in list.
        from plait.plugins import tensor_parallel

        plugins.register(tensor_parallel, "tensor_parallel")
    return plugins


def full_name(name: str) -> str:
    """The full model's name of a parameter of a pipeline rank's module."""
    if name.startswith("chunks."):
        return name.split(".", 2)[2]
    return name


def _engine(
    *,
    schedule: str,
    pp: int,
    virtual: int,
    micro_batch: int,
    global_batch: int,
    max_norm: float,
    tp: int = 1,
    sequence_parallel: bool = False,
) -> tuple[Engine, RecordingSGD, OpCounter]:
    optimizers: list[RecordingSGD] = []
    counter = OpCounter()

    def factory(params: Any) -> torch.optim.Optimizer:
        optimizers.append(RecordingSGD(params, lr=LR))
        return optimizers[-1]

    engine = Engine(
        config={
            "model": {"name": "llama", "size": "tiny", "overrides": MODEL},
            "data": {"seq_len": SEQ},
            "train": {
                "global_batch_size": global_batch,
                "micro_batch_size": micro_batch,
                "max_grad_norm": max_norm,
                "device": "cpu",
            },
            "parallel": {"pp": pp, "tp": tp},
            "schedule": {"name": schedule, "virtual_stages": virtual},
            "telemetry": {"enabled": False},
            **({"tp": {"sequence_parallel": True}} if sequence_parallel else {}),
        },
        optimizer=factory,
        plugins=_plugins(counter),
    )
    return engine, optimizers[0], counter


def train(
    rank: int,
    world_size: int,
    runs: list[dict[str, Any]],
    steps: int,
    max_norm: float = 0.3,
) -> list[dict[str, Any]]:
    """Train once per entry of `runs` ({schedule, pp, global_batch, virtual, tp, errors});
    return per-run records (with `errors`: the errors raised by bad pipeline configs)."""
    results = []
    for run in runs:
        if run.get("errors"):
            results.append(errors(rank, world_size))
            continue
        global_batch = run["global_batch"]
        engine, optimizer, counter = _engine(
            schedule=run["schedule"],
            pp=run["pp"],
            virtual=run.get("virtual", 1),
            micro_batch=1,
            global_batch=global_batch,
            max_norm=max_norm,
            tp=run.get("tp", 1),
            sequence_parallel=run.get("sequence_parallel", False),
        )
        names = {id(p): full_name(n) for n, p in engine.module.named_parameters()}
        dp_size, dp_rank = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
        losses, norms, bubbles, idle_spans, late_receives = [], [], [], 0, 0
        kind_counts, kinds_add_up, waits_in_window = {}, False, True
        for inputs, targets in global_batches(steps, global_batch):
            counter.recv_issued_ns.clear()
            share = global_batch // dp_size
            rows = slice(dp_rank * share, (dp_rank + 1) * share)
            losses.append(engine.train_step((inputs[rows], targets[rows])))
            norms.append(engine.last_report.grad_norm)
            idle_spans += sum(1 for s in engine.last_report.spans if s.name == "idle")
            late_receives = max(
                late_receives,
                receives_posted_in_their_own_action(counter, engine.last_report.spans),
            )
            pipeline_runtime = next(
                (rt for rt in engine.runtimes if isinstance(rt, PipelineRuntime)), None
            )
            if pipeline_runtime is not None:
                bubbles.append(pipeline_runtime.last_bubble_fraction)
                times = pipeline_runtime.last_stage_times
                kind_counts = dict(times.kind_counts)
                kinds_add_up = math.isclose(
                    sum(times.kind_seconds.values()), times.busy_seconds, rel_tol=1e-9
                )
                # waits and compute are disjoint intervals of the window
                waits_in_window &= times.recv_wait_seconds <= times.idle_seconds + 1e-6
        ddp_runtime = next(
            (rt for rt in engine.runtimes if isinstance(rt, BucketedAllReduce)), None
        )
        grads = [{names[i]: g for i, g in step.items()} for step in optimizer.seen]
        plan = None if pipeline_runtime is None else pipeline_runtime.plan
        results.append(
            {
                **run,
                "losses": losses,
                "grad_norms": norms,
                "grads": grads,
                "bubbles": bubbles,
                "kind_counts": kind_counts,  # compute actions by kind, last step
                "kinds_add_up": kinds_add_up,
                "waits_in_window": waits_in_window,  # every step
                "idle_spans": idle_spans,
                "late_receives": late_receives,  # most in one step
                "num_microbatches": global_batch // dp_size,
                "plan": None if plan is None else [c.layers for c in plan.chunks],
                "ops_per_step": {k: v / steps for k, v in counter.counts.items()},
                "num_buckets": len(ddp_runtime.buckets) if ddp_runtime else 0,
                "tp_rank": engine.mesh.coordinate("tp"),
            }
        )
        engine.close()
    return results


def errors(rank: int, world_size: int) -> dict[str, str]:
    """The errors a 2-stage pipeline raises for too few micro-batches and too few layers."""
    del rank, world_size
    found = {}
    engine, _, _ = _engine(
        schedule="1f1b", pp=2, virtual=1, micro_batch=1, global_batch=1, max_norm=0.0
    )
    ((inputs, targets),) = global_batches(1, 1)
    try:
        engine.train_step((inputs, targets))
    except PlaitError as exc:
        found["microbatches"] = str(exc)
    try:
        _engine(
            schedule="interleaved_1f1b",
            pp=2,
            virtual=8,
            micro_batch=1,
            global_batch=4,
            max_norm=0.0,
        )
    except PlaitError as exc:
        found["layers"] = str(exc)
    return found
