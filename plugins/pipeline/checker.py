"""The schedule checker: verify any set of per-rank action lists before a step runs them.

`check_schedule` proves, on the data alone, that a pipeline program can run:

1. every action is well formed: micro-batch and chunk in range, `peer_stage` the rank that
   really holds the neighbouring global stage, no send past the last stage or receive before the
   first;
2. on every rank, every (micro-batch, chunk) is forwarded exactly once and backwarded exactly
   once (`full`, or `input` then `weight`); a forward comes after receiving its activation, a
   backward after its forward and after receiving its output gradient, a weight gradient after
   the input gradient, a send after the compute producing it; `SyncGradients` then
   `OptimizerStep` come once each, after all compute;
3. every send is received exactly once by its peer and every receive has a send, in the same
   order on every channel (ordered pair of ranks), since P2P messages are matched in posting
   order;
4. no deadlock: a discrete-event run where sends never block and a receive blocks until its
   matching send has been issued completes on every rank.

Any violation raises `ScheduleError` naming the rank, the position and the action.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from plait.core.errors import ScheduleError
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    SendActivation,
    SendGrad,
    SyncGradients,
    format_action,
)
from plait.plugins.pipeline.topology import (
    Layout,
    Message,
    consumed_message,
    message_of,
    produced_message,
)

Channel = tuple[int, int]  # (sending rank, receiving rank)


def _where(rank: int, index: int, action: Action) -> str:
    return f"rank {rank}, action {index} ({format_action(action)}, {action!r})"


def _moved_message(action: Action, rank: int, layout: Layout) -> Message:
    moved = message_of(action, rank, layout)
    if moved is None:
        raise TypeError(f"not a send or receive: {action!r}")
    return moved[1]


@dataclass
class _RankState:
    """What one rank has done so far while its list is walked in order."""

    forwarded: set[tuple[int, int]] = field(default_factory=set)
    backward_kinds: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    received: set[Message] = field(default_factory=set)
    produced: set[Message] = field(default_factory=set)
    sync_at: list[int] = field(default_factory=list)
    step_at: list[int] = field(default_factory=list)


def _check_fields(
    action: Action, rank: int, index: int, layout: Layout, num_microbatches: int
) -> None:
    if isinstance(action, SyncGradients | OptimizerStep):
        return
    if not isinstance(
        action, Forward | Backward | SendActivation | RecvActivation | SendGrad | RecvGrad
    ):
        raise ScheduleError(f"rank {rank}, action {index}: not a schedule action: {action!r}")
    if not 0 <= action.microbatch < num_microbatches:
        raise ScheduleError(
            f"{_where(rank, index, action)}: micro-batch outside 0..{num_microbatches - 1}"
        )
    if not 0 <= action.chunk < layout.virtual_stages:
        raise ScheduleError(
            f"{_where(rank, index, action)}: chunk outside 0..{layout.virtual_stages - 1}"
        )
    direction_and_message = message_of(action, rank, layout)
    if direction_and_message is None:
        return
    direction, message = direction_and_message
    peer_stage = message.dst_stage if direction == "send" else message.src_stage
    if not 0 <= peer_stage <= layout.last_global_stage:
        own_stage = layout.global_stage(rank, action.chunk)
        edge = "last" if peer_stage > layout.last_global_stage else "first"
        raise ScheduleError(
            f"{_where(rank, index, action)}: global stage {own_stage} is the {edge} stage of "
            f"{layout.num_global_stages}, so there is no stage {peer_stage} to {direction} "
            f"{message.kind} {'to' if direction == 'send' else 'from'}"
        )
    expected_peer = layout.rank_of(peer_stage)
    if action.peer_stage != expected_peer:
        raise ScheduleError(
            f"{_where(rank, index, action)}: peer_stage should be {expected_peer} (rank holding "
            f"global stage {peer_stage}), got {action.peer_stage}"
        )


def _walk_rank(
    rank: int, program: Sequence[Action], layout: Layout, num_microbatches: int
) -> _RankState:
    """Check one rank's list in order: data dependencies and the position of sync and step."""
    state = _RankState()
    for index, action in enumerate(program):
        where = _where(rank, index, action)
        if isinstance(action, Forward | Backward):
            if state.sync_at:
                raise ScheduleError(f"{where}: compute after SyncGradients")
            produced = produced_message(action, rank, layout)
            if produced is not None:
                state.produced.add(produced)
        match action:
            case Forward(microbatch=mb, chunk=c):
                if (mb, c) in state.forwarded:
                    raise ScheduleError(f"{where}: micro-batch {mb} chunk {c} forwarded twice")
                needed = consumed_message(action, rank, layout)
                if needed is not None and needed not in state.received:
                    raise ScheduleError(
                        f"{where}: runs before receiving activation {needed.label()}"
                    )
                state.forwarded.add((mb, c))
            case Backward(microbatch=mb, chunk=c, kind=kind):
                kinds = state.backward_kinds.setdefault((mb, c), [])
                if (mb, c) not in state.forwarded:
                    raise ScheduleError(f"{where}: backward before the forward of micro-batch {mb}")
                if kind in kinds or (kind == "full" and kinds) or "full" in kinds:
                    raise ScheduleError(
                        f"{where}: micro-batch {mb} chunk {c} already had backward {kinds}"
                    )
                if kind == "weight" and "input" not in kinds:
                    raise ScheduleError(f"{where}: weight gradient before the input gradient")
                needed = consumed_message(action, rank, layout)
                if needed is not None and needed not in state.received:
                    raise ScheduleError(f"{where}: runs before receiving gradient {needed.label()}")
                kinds.append(kind)
            case SendActivation() | SendGrad():
                message = _moved_message(action, rank, layout)
                if message not in state.produced:
                    raise ScheduleError(f"{where}: sends {message.label()} before computing it")
            case RecvActivation() | RecvGrad():
                state.received.add(_moved_message(action, rank, layout))
            case SyncGradients():
                state.sync_at.append(index)
            case OptimizerStep():
                if not state.sync_at:
                    raise ScheduleError(f"{where}: optimizer step before SyncGradients")
                state.step_at.append(index)
    if len(state.sync_at) != 1 or len(state.step_at) != 1:
        raise ScheduleError(
            f"rank {rank}: needs exactly one SyncGradients and one OptimizerStep, got "
            f"{len(state.sync_at)} and {len(state.step_at)}"
        )
    return state


def _check_coverage(rank: int, state: _RankState, layout: Layout, num_microbatches: int) -> None:
    for chunk in range(layout.virtual_stages):
        for mb in range(num_microbatches):
            what = f"rank {rank}: micro-batch {mb} chunk {chunk}"
            if (mb, chunk) not in state.forwarded:
                raise ScheduleError(f"{what} is never forwarded")
            kinds = sorted(state.backward_kinds.get((mb, chunk), []))
            if kinds not in (["full"], ["input", "weight"]):
                missing = "weight gradient" if kinds == ["input"] else "backward"
                raise ScheduleError(f"{what} has no {missing}")


def _channel_orders(
    programs: Mapping[int, Sequence[Action]], layout: Layout
) -> tuple[dict[Channel, list[tuple[int, Message]]], dict[Channel, list[tuple[int, Message]]]]:
    """Per channel, the (position, message) of every send and every receive in list order."""
    sends: dict[Channel, list[tuple[int, Message]]] = defaultdict(list)
    recvs: dict[Channel, list[tuple[int, Message]]] = defaultdict(list)
    for rank, program in programs.items():
        for index, action in enumerate(program):
            moved = message_of(action, rank, layout)
            if moved is None:
                continue
            direction, message = moved
            if direction == "send":
                sends[(rank, layout.rank_of(message.dst_stage))].append((index, message))
            else:
                recvs[(layout.rank_of(message.src_stage), rank)].append((index, message))
    return sends, recvs


def _check_matching(
    sends: dict[Channel, list[tuple[int, Message]]],
    recvs: dict[Channel, list[tuple[int, Message]]],
) -> None:
    for channel in sorted(set(sends) | set(recvs)):
        src, dst = channel
        sent: dict[Message, int] = {}
        for index, message in sends.get(channel, []):
            if message in sent:
                raise ScheduleError(
                    f"rank {src}, action {index}: sends {message.label()} twice (first at action "
                    f"{sent[message]})"
                )
            sent[message] = index
        received: dict[Message, int] = {}
        for index, message in recvs.get(channel, []):
            if message in received:
                raise ScheduleError(
                    f"rank {dst}, action {index}: receives {message.label()} twice (first at "
                    f"action {received[message]})"
                )
            received[message] = index
        for message, index in sent.items():
            if message not in received:
                raise ScheduleError(
                    f"unmatched send: rank {src}, action {index} sends {message.label()} to rank "
                    f"{dst}, which never receives it"
                )
        for message, index in received.items():
            if message not in sent:
                raise ScheduleError(
                    f"unmatched receive: rank {dst}, action {index} receives {message.label()} "
                    f"from rank {src}, which never sends it"
                )
        for position, ((send_index, sent_msg), (recv_index, recv_msg)) in enumerate(
            zip(sends[channel], recvs[channel], strict=True)
        ):
            if sent_msg != recv_msg:
                raise ScheduleError(
                    f"channel rank {src} -> rank {dst}: message {position} is sent as "
                    f"{sent_msg.label()} (rank {src}, action {send_index}) but received as "
                    f"{recv_msg.label()} (rank {dst}, action {recv_index}); P2P messages are "
                    "matched in posting order, so both sides must use the same order"
                )


def _check_deadlock(programs: Mapping[int, Sequence[Action]], layout: Layout) -> None:
    """Run all ranks together: a receive waits until its send is issued; sends never wait."""
    position = dict.fromkeys(programs, 0)
    issued: set[Message] = set()
    progressed = True
    while progressed:
        progressed = False
        for rank, program in programs.items():
            while position[rank] < len(program):
                moved = message_of(program[position[rank]], rank, layout)
                if moved is not None:
                    direction, message = moved
                    if direction == "recv" and message not in issued:
                        break
                    if direction == "send":
                        issued.add(message)
                position[rank] += 1
                progressed = True
    stuck = {rank: index for rank, index in position.items() if index < len(programs[rank])}
    if not stuck:
        return
    lines = []
    for rank, index in sorted(stuck.items()):
        action = programs[rank][index]
        message = _moved_message(action, rank, layout)
        peer = layout.rank_of(message.src_stage)
        if peer in stuck:
            peer_action = format_action(programs[peer][stuck[peer]])
            peer_state = f"rank {peer} is stuck at action {stuck[peer]} ({peer_action})"
        else:
            peer_state = f"rank {peer} finished without sending it"
        lines.append(
            f"rank {rank} waits at action {index} ({format_action(action)}: {message.label()}); "
            f"{peer_state}"
        )
    raise ScheduleError("deadlock: " + "; ".join(lines))


def check_schedule(
    programs: Mapping[int, Sequence[Action]],
    *,
    num_microbatches: int,
    num_stages: int,
    virtual_stages: int = 1,
) -> None:
    """Verify per-rank programs (keyed by pipeline rank); raise `ScheduleError` if one is wrong."""
    if sorted(programs) != list(range(num_stages)):
        raise ScheduleError(
            f"expected programs for ranks 0..{num_stages - 1}, got ranks {sorted(programs)}"
        )
    layout = Layout(num_stages, virtual_stages)
    for rank in range(num_stages):
        for index, action in enumerate(programs[rank]):
            _check_fields(action, rank, index, layout, num_microbatches)
    # Matching first: a send nobody receives is the cause; the receiver's compute running
    # without its input would only be the symptom.
    sends, recvs = _channel_orders(programs, layout)
    _check_matching(sends, recvs)
    for rank in range(num_stages):
        state = _walk_rank(rank, programs[rank], layout, num_microbatches)
        _check_coverage(rank, state, layout, num_microbatches)
    _check_deadlock(programs, layout)
