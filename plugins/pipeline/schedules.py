"""Pipeline schedules as plain action lists: GPipe, 1F1B, interleaved 1F1B and zero-bubble ZB-H1.

Each schedule is built in two steps. First the *compute order* of every rank — the sequence of
`Forward` / `Backward` actions, which is what distinguishes one schedule from another. Then
`attach_communication` inserts the point-to-point actions the same way for all of them:

- a send right after the compute that produces its tensor;
- before a compute that needs a tensor, the receives on that channel (the ordered pair of ranks)
  up to and including the one it needs, in the order the peer sends them.

Execution model the lists are built for (and that `checker.check_schedule` verifies): a rank runs
its actions in order; a send is an `isend` whose completion is only awaited before the buffer is
reused or at the end of the step, so it never blocks the list; a receive is an `irecv` posted in
list order and waited before the compute that needs it. Messages on one channel are matched in
posting order (NCCL ignores tags, so the k-th send from rank a to rank b must be the k-th receive
on b from a). Because receives follow the sender's order and a send is never later than the
compute producing it, a rank waiting for a receive only ever waits for a tensor its peer produces
without needing anything back: the programs are deadlock-free whenever the compute orders are.
Adjacent communication actions (e.g. `SendActivation` then `RecvGrad` in the 1F1B steady state)
may be issued as one `batch_isend_irecv` group, which NCCL needs to avoid serialising them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from plait.core.errors import ScheduleError
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    ScheduleRequest,
    SyncGradients,
)
from plait.plugins.pipeline.topology import (
    Layout,
    Message,
    consumed_message,
    produced_message,
    recv_action,
    send_action,
)

Compute = Forward | Backward
ComputeOrderBuilder = Callable[[int, int, int, int], list[Compute]]
"""(num_microbatches, num_stages, virtual_stages, rank) -> that rank's compute order."""


def gpipe_order(
    num_microbatches: int, num_stages: int, virtual_stages: int, rank: int
) -> list[Compute]:
    """All forwards, then all backwards (Huang et al. 2019): m activations held at once."""
    forwards: list[Compute] = [Forward(microbatch=mb) for mb in range(num_microbatches)]
    return forwards + [Backward(microbatch=mb) for mb in range(num_microbatches)]


def one_f_one_b_order(
    num_microbatches: int, num_stages: int, virtual_stages: int, rank: int
) -> list[Compute]:
    """PipeDream-flush / Megatron 1F1B: `P-1-rank` warm-up forwards, then one forward and one
    backward alternately, then the remaining backwards. At most `P - rank` activations live."""
    warmup = min(num_stages - 1 - rank, num_microbatches)
    order: list[Compute] = [Forward(microbatch=mb) for mb in range(warmup)]
    for mb in range(num_microbatches - warmup):
        order += [Forward(microbatch=warmup + mb), Backward(microbatch=mb)]
    order += [Backward(microbatch=mb) for mb in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_order(
    num_microbatches: int, num_stages: int, virtual_stages: int, rank: int
) -> list[Compute]:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, §2.2).

    Micro-batches advance in groups of `P`: the k-th forward of a rank runs chunk
    `(k mod P·v) div P` on micro-batch `(k div P·v)·P + k mod P`; backwards walk the chunks in
    reverse. Warm-up is `2·(P-1-rank) + (v-1)·P` forwards, so the first backward of every rank
    finds its gradient already on its way.
    """
    group = num_stages * virtual_stages
    total = num_microbatches * virtual_stages

    def microbatch(k: int) -> int:
        return (k // group) * num_stages + k % num_stages

    def forward(k: int) -> Forward:
        return Forward(microbatch=microbatch(k), chunk=(k % group) // num_stages)

    def backward(k: int) -> Backward:
        chunk = virtual_stages - 1 - (k % group) // num_stages
        return Backward(microbatch=microbatch(k), chunk=chunk)

    warmup = min(2 * (num_stages - 1 - rank) + (virtual_stages - 1) * num_stages, total)
    order: list[Compute] = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [forward(warmup + k), backward(k)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def zb_h1_order(
    num_microbatches: int, num_stages: int, virtual_stages: int, rank: int
) -> list[Compute]:
    """Zero-bubble ZB-H1 (Qi et al. 2023, §3.1): 1F1B with each backward split into the input
    gradient `I`, which is on the critical path to the previous stage, and the weight gradient
    `W`, which is not. Rank `p` postpones its first `p` weight gradients; the postponed `W`s fill
    the 1F1B cool-down bubbles. Peak activation memory stays that of 1F1B (`P` micro-batches on
    the first rank) and the bubble shrinks from `(P-1)·(F+B)` to `(P-1)·(F+I-W)`.
    """
    warmup = min(num_stages - 1 - rank, num_microbatches)
    order: list[Compute] = [Forward(microbatch=mb) for mb in range(warmup)]
    next_weight = 0
    for backward_index in range(num_microbatches):
        forward_mb = warmup + backward_index
        if forward_mb < num_microbatches:
            order.append(Forward(microbatch=forward_mb))
        order.append(Backward(microbatch=backward_index, kind="input"))
        if backward_index >= rank:
            order.append(Backward(microbatch=next_weight, kind="weight"))
            next_weight += 1
    order += [Backward(microbatch=mb, kind="weight") for mb in range(next_weight, num_microbatches)]
    return order


def attach_communication(
    compute_orders: dict[int, list[Compute]], layout: Layout
) -> dict[int, list[Action]]:
    """Turn every rank's compute order into a full program with sends, receives, gradient sync
    and optimizer step (see the module docstring for the ordering rules)."""
    channels: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for rank, order in compute_orders.items():
        for action in order:
            message = produced_message(action, rank, layout)
            if message is not None:
                channels[(rank, layout.rank_of(message.dst_stage))].append(message)
    positions = {
        channel: {message: index for index, message in enumerate(messages)}
        for channel, messages in channels.items()
    }

    programs: dict[int, list[Action]] = {}
    for rank, order in compute_orders.items():
        received: dict[tuple[int, int], int] = defaultdict(int)
        program: list[Action] = []
        for action in order:
            needed = consumed_message(action, rank, layout)
            if needed is not None:
                channel = (layout.rank_of(needed.src_stage), rank)
                target = positions.get(channel, {}).get(needed)
                if target is None:
                    raise ScheduleError(
                        f"rank {rank}: {action} needs {needed.label()}, which no rank produces"
                    )
                while received[channel] <= target:
                    program.append(recv_action(channels[channel][received[channel]], layout))
                    received[channel] += 1
            program.append(action)
            produced = produced_message(action, rank, layout)
            if produced is not None:
                program.append(send_action(produced, layout))
        programs[rank] = [*program, SyncGradients(), OptimizerStep()]
    return programs


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSchedule:
    """A built-in pipeline schedule: its compute order and what it needs to be valid."""

    name: str
    compute_order: ComputeOrderBuilder
    supports_virtual_stages: bool
    requirement: str  # stated in errors
    description: str

    def validate(self, *, num_microbatches: int, num_stages: int, virtual_stages: int) -> None:
        """Raise `ScheduleError` naming what this schedule needs when the request cannot run."""
        if num_stages < 1 or num_microbatches < 1 or virtual_stages < 1:
            raise ScheduleError(
                f"schedule {self.name!r}: pp, micro-batches and virtual stages must be >= 1, got "
                f"pp={num_stages}, microbatches={num_microbatches}, virtual={virtual_stages}"
            )
        if virtual_stages > 1 and not self.supports_virtual_stages:
            raise ScheduleError(
                f"schedule {self.name!r} does not support virtual stages (got virtual_stages="
                f"{virtual_stages}); use 'interleaved_1f1b' or set virtual_stages = 1"
            )
        needs_more = False
        if self.name in ("1f1b", "zb_h1"):
            needs_more = num_microbatches < num_stages
        elif self.name == "interleaved_1f1b":
            if virtual_stages < 2 or num_stages < 2:
                raise ScheduleError(
                    f"schedule {self.name!r} needs pp >= 2 and virtual_stages >= 2 (got pp="
                    f"{num_stages}, virtual_stages={virtual_stages}); with one chunk per rank "
                    "use '1f1b'"
                )
            needs_more = num_microbatches < num_stages or num_microbatches % num_stages != 0
        if needs_more:
            raise ScheduleError(
                f"schedule {self.name!r} with pp={num_stages} needs {self.requirement}, got "
                f"{num_microbatches} micro-batches"
            )

    def build(
        self, *, num_microbatches: int, num_stages: int, virtual_stages: int = 1
    ) -> dict[int, list[Action]]:
        """The programs of all ranks, keyed by pipeline rank."""
        self.validate(
            num_microbatches=num_microbatches,
            num_stages=num_stages,
            virtual_stages=virtual_stages,
        )
        orders = {
            rank: self.compute_order(num_microbatches, num_stages, virtual_stages, rank)
            for rank in range(num_stages)
        }
        return attach_communication(orders, Layout(num_stages, virtual_stages))


SCHEDULES: dict[str, PipelineSchedule] = {
    schedule.name: schedule
    for schedule in (
        PipelineSchedule(
            name="gpipe",
            compute_order=gpipe_order,
            supports_virtual_stages=False,
            requirement="at least 1 micro-batch",
            description="GPipe: all forwards, then all backwards",
        ),
        PipelineSchedule(
            name="1f1b",
            compute_order=one_f_one_b_order,
            supports_virtual_stages=False,
            requirement="at least as many micro-batches as stages (microbatches >= pp)",
            description="1F1B (PipeDream-flush): warm-up, one forward one backward, cool-down",
        ),
        PipelineSchedule(
            name="interleaved_1f1b",
            compute_order=interleaved_order,
            supports_virtual_stages=True,
            requirement="a multiple of pp micro-batches, at least pp (microbatches % pp == 0)",
            description="Megatron interleaved 1F1B over virtual stages (chunk c on rank p is "
            "global stage c*pp + p)",
        ),
        PipelineSchedule(
            name="zb_h1",
            compute_order=zb_h1_order,
            supports_virtual_stages=False,
            requirement="at least as many micro-batches as stages (microbatches >= pp)",
            description="zero-bubble ZB-H1: 1F1B with split backward, weight gradients deferred "
            "into the bubbles",
        ),
    )
}


def build_programs(
    name: str, *, num_microbatches: int, num_stages: int, virtual_stages: int = 1
) -> dict[int, list[Action]]:
    """The programs of every rank for a built-in schedule, keyed by pipeline rank."""
    if name not in SCHEDULES:
        raise ScheduleError(
            f"no built-in pipeline schedule {name!r}; built in: {', '.join(sorted(SCHEDULES))}"
        )
    return SCHEDULES[name].build(
        num_microbatches=num_microbatches, num_stages=num_stages, virtual_stages=virtual_stages
    )


def build_schedule(request: ScheduleRequest) -> list[Action]:
    """Answer a `ScheduleRequest` for one rank (`request.stage`) of a built-in schedule."""
    if not 0 <= request.stage < request.num_stages:
        raise ScheduleError(
            f"schedule {request.name!r}: stage {request.stage} is outside "
            f"0..{request.num_stages - 1}"
        )
    programs = build_programs(
        request.name,
        num_microbatches=request.num_microbatches,
        num_stages=request.num_stages,
        virtual_stages=request.virtual_stages,
    )
    return programs[request.stage]
