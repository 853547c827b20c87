"""Where pipeline messages go: global stages, model chunks and the P2P message each action moves.

With `P` pipeline ranks and `v` virtual stages, the model is cut into `P·v` consecutive *global
stages*; rank `p` holds local chunks `c = 0..v-1`, chunk `c` being global stage `c·P + p`
(Megatron's interleaved placement; with `v = 1` global stage and rank coincide).

In an action list the `chunk` field is always the *local* chunk of the rank running the action:
`SendActivation(chunk=c)` sends the output of this rank's chunk `c`; `RecvActivation(chunk=c)`
receives the input of this rank's chunk `c`. `peer_stage` is the pipeline rank at the other end.
The builder, the checker and the timeline all derive messages from actions through this module,
so the three can never disagree about who talks to whom.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
)

MessageKind = Literal["activation", "grad"]


@dataclass(frozen=True, slots=True)
class Layout:
    """How global stages map onto pipeline ranks and their local chunks."""

    num_stages: int
    virtual_stages: int = 1

    @property
    def num_global_stages(self) -> int:
        return self.num_stages * self.virtual_stages

    @property
    def last_global_stage(self) -> int:
        return self.num_global_stages - 1

    def global_stage(self, rank: int, chunk: int) -> int:
        return chunk * self.num_stages + rank

    def rank_of(self, global_stage: int) -> int:
        return global_stage % self.num_stages

    def chunk_of(self, global_stage: int) -> int:
        return global_stage // self.num_stages


@dataclass(frozen=True, slots=True)
class Message:
    """One point-to-point tensor: the activation or gradient of `microbatch` between two stages."""

    kind: MessageKind
    microbatch: int
    src_stage: int  # global stage
    dst_stage: int  # global stage

    def label(self) -> str:
        prefix = "A" if self.kind == "activation" else "G"
        return f"{prefix}{self.microbatch} (stage {self.src_stage}->{self.dst_stage})"


def produced_message(action: Forward | Backward, rank: int, layout: Layout) -> Message | None:
    """The message a compute action's result must be sent as, if any."""
    stage = layout.global_stage(rank, action.chunk)
    if isinstance(action, Forward):
        if stage == layout.last_global_stage:
            return None
        return Message("activation", action.microbatch, stage, stage + 1)
    if action.kind == "weight" or stage == 0:
        return None
    return Message("grad", action.microbatch, stage, stage - 1)


def consumed_message(action: Forward | Backward, rank: int, layout: Layout) -> Message | None:
    """The message a compute action needs received before it can run, if any."""
    stage = layout.global_stage(rank, action.chunk)
    if isinstance(action, Forward):
        if stage == 0:
            return None
        return Message("activation", action.microbatch, stage - 1, stage)
    if action.kind == "weight" or stage == layout.last_global_stage:
        return None
    return Message("grad", action.microbatch, stage + 1, stage)


def send_action(message: Message, layout: Layout) -> SendActivation | SendGrad:
    cls = SendActivation if message.kind == "activation" else SendGrad
    return cls(
        microbatch=message.microbatch,
        chunk=layout.chunk_of(message.src_stage),
        peer_stage=layout.rank_of(message.dst_stage),
    )


def recv_action(message: Message, layout: Layout) -> RecvActivation | RecvGrad:
    cls = RecvActivation if message.kind == "activation" else RecvGrad
    return cls(
        microbatch=message.microbatch,
        chunk=layout.chunk_of(message.dst_stage),
        peer_stage=layout.rank_of(message.src_stage),
    )


def message_of(
    action: Action, rank: int, layout: Layout
) -> tuple[Literal["send", "recv"], Message] | None:
    """For a send or receive action on `rank`: its direction and the message it moves.

    The message is derived from the action's own chunk and direction; whether `peer_stage`
    agrees with it is for the caller (the checker) to verify.
    """
    match action:
        case SendActivation(microbatch=mb, chunk=c):
            stage = layout.global_stage(rank, c)
            return "send", Message("activation", mb, stage, stage + 1)
        case RecvActivation(microbatch=mb, chunk=c):
            stage = layout.global_stage(rank, c)
            return "recv", Message("activation", mb, stage - 1, stage)
        case SendGrad(microbatch=mb, chunk=c):
            stage = layout.global_stage(rank, c)
            return "send", Message("grad", mb, stage, stage - 1)
        case RecvGrad(microbatch=mb, chunk=c):
            stage = layout.global_stage(rank, c)
            return "recv", Message("grad", mb, stage + 1, stage)
    return None
