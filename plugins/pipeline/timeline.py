"""Simulated pipeline timelines: start and end of every action, makespan, bubble, text and PNG.

`simulate_timeline` runs per-rank programs against a cost model (by default F = 1, full B = 2,
split B = I 1 + W 1, communication free) with the same semantics the checker verifies: a rank
runs its list in order, a send is issued when reached and never waits, a receive completes once
its send was issued plus the P2P latency. The bubble is the idle share of the compute window:
`1 - Σ busy / (P · makespan)`. `theoretical_bubble_fraction` gives the closed forms from the
papers, so the two can be compared (`plait schedule show` prints both).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plait.core.errors import ScheduleError
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    SyncGradients,
    format_action,
)
from plait.plugins.pipeline.topology import Layout, Message, message_of

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


@dataclass(frozen=True, slots=True, kw_only=True)
class ActionCosts:
    """Time per action, per chunk. Only ratios matter for the bubble fraction."""

    forward: float = 1.0
    backward: float = 2.0  # a full backward
    backward_input: float = 1.0
    backward_weight: float = 1.0
    p2p_latency: float = 0.0
    sync: float = 0.0
    optimizer: float = 0.0

    def of(self, action: Action) -> float:
        match action:
            case Forward():
                return self.forward
            case Backward(kind="full"):
                return self.backward
            case Backward(kind="input"):
                return self.backward_input
            case Backward(kind="weight"):
                return self.backward_weight
            case SyncGradients():
                return self.sync
            case OptimizerStep():
                return self.optimizer
        return 0.0


@dataclass(frozen=True, slots=True)
class TimedAction:
    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Timeline:
    """A simulated step: every rank's actions with their times."""

    rows: dict[int, tuple[TimedAction, ...]]
    makespan: float  # end of the last forward/backward on any rank

    def busy(self, rank: int) -> float:
        return sum(
            t.end - t.start for t in self.rows[rank] if isinstance(t.action, Forward | Backward)
        )

    @property
    def bubble_fraction(self) -> float:
        if self.makespan <= 0:
            return 0.0
        total_busy = sum(self.busy(rank) for rank in self.rows)
        return 1.0 - total_busy / (len(self.rows) * self.makespan)


def simulate_timeline(
    programs: Mapping[int, Sequence[Action]],
    *,
    num_stages: int,
    virtual_stages: int = 1,
    costs: ActionCosts | Mapping[int, ActionCosts] | None = None,
) -> Timeline:
    """Time every action of every rank; raises `ScheduleError` if the programs deadlock.
    `costs` may differ per rank (a replay of a measured step, whose stages are not equal)."""
    costs = costs or ActionCosts()
    per_rank = costs if isinstance(costs, Mapping) else dict.fromkeys(programs, costs)
    if missing := sorted(set(programs) - set(per_rank)):
        raise ScheduleError(f"no action costs for ranks {missing}")
    layout = Layout(num_stages, virtual_stages)
    issued_at: dict[Message, float] = {}
    clock = dict.fromkeys(programs, 0.0)
    position = dict.fromkeys(programs, 0)
    rows: dict[int, list[TimedAction]] = {rank: [] for rank in programs}
    progressed = True
    # Ranks advance independently until they reach a receive whose send has not been simulated
    # yet; a send's time is fixed once issued, so the visiting order does not change any time.
    while progressed:
        progressed = False
        for rank, program in programs.items():
            while position[rank] < len(program):
                action = program[position[rank]]
                start = end = clock[rank]
                moved = message_of(action, rank, layout)
                if moved is not None and moved[0] == "recv":
                    if moved[1] not in issued_at:
                        break
                    end = max(start, issued_at[moved[1]] + per_rank[rank].p2p_latency)
                elif moved is not None:
                    issued_at[moved[1]] = start
                else:
                    end = start + per_rank[rank].of(action)
                rows[rank].append(TimedAction(action, start, end))
                clock[rank] = end
                position[rank] += 1
                progressed = True
    stuck = [rank for rank, program in programs.items() if position[rank] < len(program)]
    if stuck:
        raise ScheduleError(
            "the programs deadlock; stuck ranks: "
            + ", ".join(f"{r} at {format_action(programs[r][position[r]])}" for r in stuck)
        )
    compute_ends = [
        t.end for row in rows.values() for t in row if isinstance(t.action, Forward | Backward)
    ]
    return Timeline(
        rows={rank: tuple(row) for rank, row in rows.items()},
        makespan=max(compute_ends, default=0.0),
    )


def theoretical_bubble_fraction(
    schedule: str,
    *,
    num_stages: int,
    num_microbatches: int,
    virtual_stages: int = 1,
    costs: ActionCosts | None = None,
) -> tuple[float, str] | None:
    """The bubble fraction a schedule is known to reach, and its formula; `None` if unknown.

    GPipe and 1F1B: `(p-1)/(m+p-1)` (Huang et al.; Narayanan et al. 2021). Interleaved 1F1B
    shrinks the bubble time `v`-fold: `(p-1)/(v·m+p-1)`. ZB-H1 leaves a bubble of
    `(p-1)·(F+I-W)` against `m·(F+I+W)` of work per rank (Qi et al. 2023).
    """
    costs = costs or ActionCosts()
    p, m, v = num_stages, num_microbatches, virtual_stages
    if schedule in ("gpipe", "1f1b", "accumulate"):
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1)"
    if schedule == "interleaved_1f1b":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v*m+p-1)"
    if schedule == "zb_h1":
        forward, grad_input, grad_weight = (
            costs.forward,
            costs.backward_input,
            costs.backward_weight,
        )
        bubble = (p - 1) * max(forward + grad_input - grad_weight, 0.0)
        work = m * (forward + grad_input + grad_weight)
        return bubble / (bubble + work), "(p-1)(F+I-W) / ((p-1)(F+I-W) + m(F+I+W))"
    return None


def _columns(timeline: Timeline, time_unit: float) -> int:
    return math.ceil(timeline.makespan / time_unit - 1e-9)


def render_text(timeline: Timeline, *, time_unit: float = 1.0) -> str:
    """One row per rank, one column per `time_unit`; `.` is idle, labels as in `format_action`."""
    columns = _columns(timeline, time_unit)
    grid = {rank: ["."] * columns for rank in timeline.rows}
    for rank, row in timeline.rows.items():
        for timed in row:
            if not isinstance(timed.action, Forward | Backward) or timed.end <= timed.start:
                continue
            first = round(timed.start / time_unit)
            last = max(first + 1, round(timed.end / time_unit))
            for column in range(first, min(last, columns)):
                grid[rank][column] = format_action(timed.action)
    width = max([len(cell) for cells in grid.values() for cell in cells] + [2])
    name_width = len(f"rank {max(timeline.rows, default=0)}")
    ticks = "".join(
        f"{column:<{width}} " if column % 5 == 0 else " " * (width + 1) for column in range(columns)
    )
    lines = [f"{'time':<{name_width}} | {ticks}".rstrip()]
    for rank in sorted(grid):
        cells = " ".join(f"{cell:<{width}}" for cell in grid[rank])
        lines.append(f"{f'rank {rank}':<{name_width}} | {cells}".rstrip())
    return "\n".join(lines)


_COLOURS = {
    "F": "#4c72b0",
    "B": "#55a868",
    "I": "#dd8452",
    "W": "#8172b3",
}
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "input grad", "W": "weight grad"}
_IDLE_COLOUR = "#ececec"
# Layout of the picture: inches per time unit, and the widest a row may get before the
# timeline wraps into another row (about 1,300 px at 120 dpi, so it fits a screen or a page).
INCHES_PER_UNIT = 0.3
MAX_ROW_INCHES = 11.0
MARGIN_INCHES = 3.2  # rank names on the left, legend on the right
LEGEND_INCHES = 2.3
MIN_LABELLED_UNITS = 0.6  # a narrower part of an action (cut by a row's end) goes unlabelled


def _chunk_alpha(chunk: int, max_chunk: int) -> float:
    """Later model chunks are drawn lighter (interleaved schedules), the first one in full."""
    return 1.0 - 0.45 * chunk / max(1, max_chunk)


def _chunk_label(chunk: int) -> str:
    example = format_action(Forward(microbatch=0, chunk=chunk))
    return f"model chunk {chunk} (as {example}{', lighter' if chunk else ''})"


def row_span(timeline: Timeline) -> float:
    """Time units per row of the picture: the whole makespan when it fits, else a round
    number of units, so long schedules wrap into rows instead of growing wider."""
    fits = MAX_ROW_INCHES / INCHES_PER_UNIT
    if timeline.makespan <= fits:
        return max(timeline.makespan, 1.0)
    return float(max(5, int(fits) // 5 * 5))


def render_png(timeline: Timeline, path: str | Path, *, title: str = "") -> None:
    """Draw the timeline as a Gantt chart (one lane per rank) into a PNG file."""
    import matplotlib.pyplot as plt

    figure = timeline_figure(timeline, title=title)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def timeline_figure(timeline: Timeline, *, title: str = "") -> Figure:
    """The figure `render_png` saves: one panel per row of `row_span` time units, every rank
    in each, a legend naming each kind of action, each chunk's shading and the idle time."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers; explicit so a user's backend is not needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    num_ranks = max(len(timeline.rows), 1)
    span = row_span(timeline)
    panels = max(1, math.ceil(timeline.makespan / span - 1e-9))
    max_chunk = _max_chunk(timeline)
    figure, axes_list = plt.subplots(
        panels,
        1,
        figsize=(span * INCHES_PER_UNIT + MARGIN_INCHES, panels * (0.45 * num_ranks + 0.9) + 0.6),
        squeeze=False,
    )
    for panel, (axes,) in enumerate(axes_list):
        lo, hi = panel * span, (panel + 1) * span
        _draw_rows(axes, timeline, lo, hi, max_chunk)
        axes.set_xlim(lo, lo + span)  # every row on the same scale, the last one too
        axes.set_ylim(num_ranks - 0.5, -0.5)
        axes.set_yticks(range(num_ranks), [f"rank {r}" for r in range(num_ranks)])
        axes.set_facecolor(_IDLE_COLOUR)
    axes_list[-1][0].set_xlabel("time (units of one forward)")
    figure.suptitle(title or f"bubble {timeline.bubble_fraction:.3f}", fontsize=9)
    used = sorted(
        {
            format_action(t.action)[0]
            for row in timeline.rows.values()
            for t in row
            if isinstance(t.action, Forward | Backward)
        },
        key=list(_COLOURS).index,
    )
    handles = [Patch(color=_COLOURS[k], label=_KIND_NAMES[k]) for k in used]
    if max_chunk > 0:
        # Interleaved: each model chunk's shade, shown on the forward colour (X.c in labels).
        handles += [
            Patch(
                color=_COLOURS["F"],
                alpha=_chunk_alpha(chunk, max_chunk),
                label=_chunk_label(chunk),
            )
            for chunk in range(max_chunk + 1)
        ]
    handles.append(Patch(facecolor=_IDLE_COLOUR, edgecolor="#bbbbbb", label="idle (bubble)"))
    figure.legend(handles=handles, loc="upper right", fontsize=7)
    figure.tight_layout(rect=(0, 0, 1 - LEGEND_INCHES / figure.get_figwidth(), 1))
    return figure


def _draw_rows(axes: Axes, timeline: Timeline, lo: float, hi: float, max_chunk: int) -> None:
    """The part in [lo, hi) of every rank's actions, labelled; an action crossing a row's
    end is drawn in both rows, each part labelled when wide enough to hold its label."""
    for rank, row in timeline.rows.items():
        for timed in row:
            if not isinstance(timed.action, Forward | Backward) or timed.end <= timed.start:
                continue
            start, end = max(timed.start, lo), min(timed.end, hi)
            if end <= start:
                continue
            label = format_action(timed.action)
            axes.broken_barh(
                [(start, end - start)],
                (rank - 0.4, 0.8),
                facecolors=_COLOURS[label[0]],
                edgecolor="white",
                alpha=_chunk_alpha(timed.action.chunk, max_chunk),
            )
            if end - start >= MIN_LABELLED_UNITS:
                axes.text((start + end) / 2, rank, label, ha="center", va="center", fontsize=7,
                          color="white")  # fmt: skip


def _max_chunk(timeline: Timeline) -> int:
    return max(
        (
            t.action.chunk
            for row in timeline.rows.values()
            for t in row
            if isinstance(t.action, Forward | Backward)
        ),
        default=0,
    )
