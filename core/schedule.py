"""Step programs as plain data: the actions a rank runs in one optimizer step.

`plait_schedule` returns a list of these; `plait.core.executor.Executor` runs any such list.
A schedule is data, so it can be printed, checked and drawn without running a model.

Conventions: `chunk` is always the *local* model chunk of the rank running the action
(`SendActivation(chunk=c)` sends this rank's chunk-c output, `RecvActivation(chunk=c)` receives
this rank's chunk-c input); `peer_stage` is the pipeline rank at the other end. A rank runs its
list in order; sends are non-blocking and complete by the end of the step; a receive is posted
in list order and waited on before the compute that needs it; messages between a pair of ranks
match in posting order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleRequest:
    """What a schedule plugin is asked to build: the program of `stage` (a pipeline rank)."""

    name: str
    num_microbatches: int
    stage: int = 0
    num_stages: int = 1
    virtual_stages: int = 1  # model chunks per pipeline rank (interleaved schedules)


@dataclass(frozen=True, slots=True, kw_only=True)
class Forward:
    microbatch: int
    chunk: int = 0


BackwardKind = Literal["full", "input", "weight"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Backward:
    """Backward of one micro-batch; zero-bubble schedules split it into input and weight parts."""

    microbatch: int
    chunk: int = 0
    kind: BackwardKind = "full"


@dataclass(frozen=True, slots=True, kw_only=True)
class SendActivation:
    microbatch: int
    chunk: int = 0
    peer_stage: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvActivation:
    microbatch: int
    chunk: int = 0
    peer_stage: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SendGrad:
    microbatch: int
    chunk: int = 0
    peer_stage: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvGrad:
    microbatch: int
    chunk: int = 0
    peer_stage: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class SyncGradients:
    """Wait for (or start and wait for) the data-parallel gradient reduction."""


@dataclass(frozen=True, slots=True, kw_only=True)
class OptimizerStep:
    """Clip gradients, step the optimizer and the LR schedule, zero gradients."""


Action = (
    Forward
    | Backward
    | SendActivation
    | RecvActivation
    | SendGrad
    | RecvGrad
    | SyncGradients
    | OptimizerStep
)


def format_action(action: Action) -> str:
    """A short label such as `F3`, `B3`, `W3`, `sendA3`, used by `plait schedule show`."""
    match action:
        case Forward(microbatch=mb, chunk=c):
            return f"F{mb}" + (f".{c}" if c else "")
        case Backward(microbatch=mb, chunk=c, kind=kind):
            prefix = {"full": "B", "input": "I", "weight": "W"}[kind]
            return f"{prefix}{mb}" + (f".{c}" if c else "")
        case SendActivation(microbatch=mb):
            return f"sendA{mb}"
        case RecvActivation(microbatch=mb):
            return f"recvA{mb}"
        case SendGrad(microbatch=mb):
            return f"sendG{mb}"
        case RecvGrad(microbatch=mb):
            return f"recvG{mb}"
        case SyncGradients():
            return "sync"
        case OptimizerStep():
            return "step"
    raise TypeError(f"not a schedule action: {action!r}")
