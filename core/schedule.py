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


# --------------------------------------------------------------------------------------------
# step structure: what the executor tells runtimes about each compute action
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class MicrobatchPosition:
    """Where one forward, or one backward that produces weight gradients, sits in its step.

    Derived from the schedule's action list alone (`microbatch_positions`), never from
    micro-batch numbers: a schedule may run micro-batches in any order that respects the
    dependencies, and `first` / `last` still name the first and last such action of the chunk.
    Runtimes receive it in `ParallelRuntime.before_forward` / `before_backward`.
    """

    microbatch: int
    chunk: int
    num_microbatches: int
    index: int  # how many actions of the same kind on the same chunk ran before this one
    first: bool  # the chunk's first forward (or weight-producing backward) of the step
    last: bool  # the chunk's last one: after it, the chunk's gradients are complete
    # True when the gradients accumulated in `.grad` by this backward are handed on to data
    # parallelism right after it: on the chunk's last backward, or on every backward when a
    # runtime consumes `.grad` each micro-batch (ZeRO-2/3). Hooks that act on the accumulated
    # gradient (tensor parallel's sum of partial gradients) act exactly then.
    gradients_final: bool = False


def produces_weight_gradients(action: Action) -> bool:
    """A full backward or the weight half of a split one; the input half produces none."""
    return isinstance(action, Backward) and action.kind != "input"


def microbatch_positions(
    actions: list[Action] | tuple[Action, ...],
    *,
    num_microbatches: int,
    gradients_consumed_each_microbatch: bool = False,
) -> dict[Action, MicrobatchPosition]:
    """The position of every forward and weight-producing backward in `actions`, by action."""
    counted: dict[tuple[str, int], list[Action]] = {}
    for action in actions:
        if isinstance(action, Forward):
            counted.setdefault(("forward", action.chunk), []).append(action)
        elif produces_weight_gradients(action):
            assert isinstance(action, Backward)
            counted.setdefault(("backward", action.chunk), []).append(action)
    positions: dict[Action, MicrobatchPosition] = {}
    for (kind, chunk), ordered in counted.items():
        for index, action in enumerate(ordered):
            last = index == len(ordered) - 1
            positions[action] = MicrobatchPosition(
                microbatch=action.microbatch,  # type: ignore[union-attr]
                chunk=chunk,
                num_microbatches=num_microbatches,
                index=index,
                first=index == 0,
                last=last,
                gradients_final=kind == "backward" and (last or gradients_consumed_each_microbatch),
            )
    return positions
