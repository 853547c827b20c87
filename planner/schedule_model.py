"""What a pipeline schedule costs: micro-batches held at once, and the step's makespan.

Both come from the schedules plait runs (`plait.plugins.pipeline.schedules`) and its timeline
simulator (`plait.plugins.pipeline.timeline`), not from closed forms, so a new schedule is priced
the moment it is registered. Long programs (many stages × micro-batches) fall back to the
closed forms the simulator is tested against, to keep a search over thousands of layouts fast.
"""

from __future__ import annotations

from functools import lru_cache

from plait.core.schedule import Backward, Forward
from plait.plugins.pipeline.schedules import SCHEDULES, build_programs
from plait.plugins.pipeline.timeline import (
    ActionCosts,
    simulate_timeline,
    theoretical_bubble_fraction,
)

SIMULATE_UP_TO_ACTIONS = 2500


@lru_cache(maxsize=4096)
def max_in_flight(schedule: str, *, stages: int, microbatches: int, virtual: int, rank: int) -> int:
    """Most (chunk, micro-batch) forwards whose backward has not run yet, on pipeline `rank`."""
    if schedule == "accumulate" or stages == 1:
        return 1
    # The count saturates once the steady state is reached; a few rounds of pp micro-batches
    # give the same maximum as thousands.
    capped = min(microbatches, 3 * stages)
    if schedule == "interleaved_1f1b":
        capped = max(stages, capped - capped % stages)
    order = SCHEDULES[schedule].compute_order(capped, stages, virtual, rank)
    live: set[tuple[int, int]] = set()
    peak = 0
    for action in order:
        if isinstance(action, Forward):
            live.add((action.chunk, action.microbatch))
            peak = max(peak, len(live))
        elif isinstance(action, Backward) and action.kind in ("full", "input"):
            live.discard((action.chunk, action.microbatch))
    if schedule == "gpipe":
        return peak * microbatches // capped
    return peak


def pipeline_makespan(
    schedule: str,
    *,
    stages: int,
    microbatches: int,
    virtual: int,
    forward: float,
    backward: float,
    p2p: float,
) -> float:
    """Seconds from the first forward to the last backward of one step; `forward` / `backward`
    are one chunk's times for one micro-batch, `p2p` one activation transfer."""
    if stages == 1 or schedule == "accumulate":
        return microbatches * (forward + backward)
    actions = stages * microbatches * virtual * 4
    if actions <= SIMULATE_UP_TO_ACTIONS and forward > 0:
        # The makespan scales with the costs: simulate in units of one forward, with the
        # ratios rounded so that near-identical layouts share one simulation.
        unit = _simulated(
            schedule,
            stages,
            microbatches,
            virtual,
            round(backward / forward, 2),
            round(p2p / forward, 3),
        )
        return unit * forward
    work = microbatches * virtual * (forward + backward)
    costs = ActionCosts(forward=forward, backward=backward)
    known = theoretical_bubble_fraction(
        schedule, num_stages=stages, num_microbatches=microbatches, virtual_stages=virtual,
        costs=costs,
    )  # fmt: skip
    bubble = known[0] if known else (stages - 1) / (microbatches + stages - 1)
    # Every stage boundary adds one transfer to the critical path on the way down and back.
    return work / (1.0 - bubble) + 2 * (stages * virtual - 1) * p2p


@lru_cache(maxsize=256)
def _programs(schedule: str, stages: int, microbatches: int, virtual: int) -> dict:
    return build_programs(
        schedule, num_microbatches=microbatches, num_stages=stages, virtual_stages=virtual
    )


@lru_cache(maxsize=4096)
def _simulated(
    schedule: str, stages: int, microbatches: int, virtual: int, backward: float, p2p: float
) -> float:
    """Makespan with a forward costing 1."""
    programs = _programs(schedule, stages, microbatches, virtual)
    costs = ActionCosts(
        forward=1.0,
        backward=backward,
        backward_input=backward / 2,
        backward_weight=backward / 2,
        p2p_latency=p2p,
    )
    return simulate_timeline(
        programs, num_stages=stages, virtual_stages=virtual, costs=costs
    ).makespan
