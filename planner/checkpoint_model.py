"""What checkpoint saves cost a training step, amortised over the save interval.

A save writes the job's model state — parameters, fp32 master weights, optimizer state — once:
replicated tensors are written by one of the ranks holding them (DCP spreads them over those
ranks), so each rank writes about `state / world` bytes. Before writing, each rank copies what
it holds off the device (`plait.plugins.checkpoint.staging`): over the host link on a GPU, at
memory bandwidth on a CPU, which is its own host. Per save, with `c` the copy, `w` the write
(a rank's share of the node's drives, `DeviceSpec.disk_bandwidth`) and `every · step` the time
between saves:

    synchronous   (checkpoint_io.async_save = false)   the step waits c + w
    asynchronous  (the default)                        the step waits c + max(w − every·step, 0)

— asynchronously the write runs beside training, and the next save waits only for a write that
outlasts the interval. On a CPU, which trains on every core of its host, the write beside
training takes its time from the steps instead (the copy into the page cache, the
serialisation and the checksums are CPU work): the job pays it all the same (`contended`), and
asynchronous saving only spreads the cost over the steps after the save
(`tools/bench/checkpoint.py`: the job 1.47× one without checkpoints asynchronously, 1.41×
synchronously, on 2 cores that all trained). Per step: the wait and the contended time divided
by `every`. A job that saves only at its end (`every = 0`) pays nothing per step; one without a
checkpoint directory, nothing at all.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from plait.planner.layouts import Job, Layout
    from plait.planner.memory_model import MemoryEstimate


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointPlan:
    """How often the job saves, and whether the write runs beside training."""

    every: int  # optimizer steps between saves; 0: only at the end
    asynchronous: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"checkpoint every must be >= 0, got {self.every}")


def checkpoint_plan(config: Mapping[str, Any]) -> CheckpointPlan | None:
    """The plan of a config's `[checkpoint_io]` (its keys as a file writes them), or None when
    it saves no checkpoints (no `dir`)."""
    section = dict(config.get("checkpoint_io") or {})
    if not section.get("dir"):
        return None
    return CheckpointPlan(
        every=int(section.get("every", 0)), asynchronous=bool(section.get("async_save", True))
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointCost:
    """One save's seconds on the busiest rank, and what they cost each step."""

    plan: CheckpointPlan
    copied_bytes: float  # what the rank copies off the device
    written_bytes: float  # what the rank writes
    copy_seconds: float
    write_seconds: float
    blocked_seconds: float  # what the saving step waits
    # the write's time beside training taken from the steps (a CPU host, whose cores all train)
    contended_seconds: float = 0.0
    per_step_seconds: float  # (blocked + contended) / every (0 when saving only at the end)

    def describe(self) -> str:
        """One line, e.g. "checkpoints every 50 steps (asynchronous): the saving step waits
        0.41 s (copy 0.41 s; write 2.10 s beside training), 8.2 ms per step"."""
        plan = self.plan
        when = f"every {plan.every} steps" if plan.every else "at the end only"
        how = f"copy {self.copy_seconds:.2f} s, write {self.write_seconds:.2f} s"
        if plan.asynchronous:
            write = f"write {self.write_seconds:.2f} s beside training"
            if self.contended_seconds:
                write += f", {self.contended_seconds:.2f} s of it taken from the training cores"
            how = f"copy {self.copy_seconds:.2f} s; {write}"
        kind = "asynchronous" if plan.asynchronous else "synchronous"
        return (
            f"checkpoints {when} ({kind}): the saving step waits {self.blocked_seconds:.2f} s "
            f"({how}), {self.per_step_seconds * 1e3:.1f} ms per step"
        )


def _written_bytes(layout: Layout, memory: MemoryEstimate) -> float:
    """A rank's share of the job's unique state: what it holds, on the device or offloaded,
    divided by how many ranks hold the same (data-parallel and context-parallel copies; ZeRO
    shards the optimizer state, and ZeRO-3 the parameters, over its shard group)."""
    copies = layout.dp * layout.cp
    sharded = copies // layout.shard_degree if layout.zero >= 1 else copies
    parameters = memory.parameters + memory.host_parameters
    optimizer = (
        memory.master_weights
        + memory.optimizer_state
        + memory.host_master_weights
        + memory.host_optimizer_state
        + memory.disk_optimizer_state
    )
    parameter_copies = sharded if layout.zero >= 3 else copies
    return parameters / max(parameter_copies, 1) + optimizer / max(sharded, 1)


def checkpoint_cost(
    job: Job, layout: Layout, memory: MemoryEstimate, step_seconds: float
) -> CheckpointCost | None:
    """The cost of `job.checkpoint` under `layout`, whose steps take `step_seconds` without
    saving; None when the job saves no checkpoints."""
    plan = job.checkpoint
    if plan is None:
        return None
    device = job.device
    resident = memory.parameters + memory.master_weights + memory.optimizer_state
    written = _written_bytes(layout, memory)
    if device.host_memory_bytes is None:  # a CPU: the copy is a memcpy in its own memory
        copy = 2 * resident / device.host_memory_bandwidth
    else:
        copy = resident / device.host_link.beta
    write = written / device.disk_bandwidth
    contended = 0.0
    if plan.asynchronous:
        interval = plan.every * step_seconds
        blocked = copy + (max(write - interval, 0.0) if plan.every else 0.0)
        if device.host_memory_bytes is None:  # the write runs on the cores that train
            contended = min(write, interval) if plan.every else write
    else:
        blocked = copy + write
    per_step = (blocked + contended) / plan.every if plan.every else 0.0
    return CheckpointCost(
        plan=plan,
        copied_bytes=resident,
        written_bytes=written,
        copy_seconds=copy,
        write_seconds=write,
        blocked_seconds=blocked,
        contended_seconds=contended,
        per_step_seconds=per_step,
    )
