"""What one optimizer step produced: the record passed to `plait_step_end` and the CLI."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True, kw_only=True)
class PhaseSpan:
    """One timed phase inside a step: forward/backward of a micro-batch, sync, optimizer, data.

    Times are `time.time_ns()` wall-clock nanoseconds, so spans from several ranks line up.
    """

    name: str  # "forward", "backward", "backward_input", "backward_weight", "sync_gradients",
    # "optimizer", "data", "send", "recv", "idle"
    start_ns: int
    end_ns: int
    microbatch: int | None = None
    chunk: int | None = None
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobInfo:
    """Who this rank is, given to `plait_job_start` once the engine is ready."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    degrees: dict[str, int]
    coordinates: dict[str, int]
    device: str  # "cpu", "cuda:0"
    device_name: str  # "NVIDIA H100 80GB HBM3", or the CPU model
    compute_dtype: str  # "float32", "bfloat16"
    model_name: str
    num_params: int
    flops_per_token: float  # training FLOPs per token, forward + backward
    tokens_per_step: int  # whole job
    # The rank's replica group in a fault-tolerant job (its own world); -1: not fault tolerant.
    replica_group: int = -1
    # Bytes this rank holds in parameters, gradients and optimizer state, counted from tensor
    # storage when called (`Engine.memory_report`); what `plait memory` reports on any device.
    memory_report: Callable[[], dict[str, int]] | None = field(
        default=None, compare=False, repr=False
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class StepReport:
    step: int
    loss: float  # mean over micro-batches and data-parallel ranks
    tokens: int  # tokens processed by the whole job in this step
    step_seconds: float
    data_wait_seconds: float
    model_flops: float  # training FLOPs of the whole job in this step
    lr: float
    grad_norm: float | None = None
    skipped: bool = False
    start_ns: int = 0
    end_ns: int = 0
    spans: tuple[PhaseSpan, ...] = ()
    phase_seconds: dict[str, float] = field(default_factory=dict)
