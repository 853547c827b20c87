"""`plait bottleneck --png`: where each rank's step time goes, as a picture read at a glance.

One panel per job (ranks of different jobs share no scale of interest and their full ids would
overlap as labels), one stacked bar per rank labelled "rank N", each segment carrying its
milliseconds when it is tall enough to hold them and each bar its total; the panel's title names
the job, its MFU and its step time, so a picture pasted alone still says what it shows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from plait.daemon.bottleneck import CLASS_LABELS
from plait.daemon.mfu import format_mfu
from plait.proto.plait.v1 import metrics_pb2

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# (class, BottleneckBreakdown field, colour), bottom to top in the order classes take precedence.
SEGMENTS = (
    ("compute", "compute_seconds", "#4c72b0"),
    ("exposed_comm", "exposed_comm_seconds", "#c44e52"),
    ("data", "data_wait_seconds", "#dd8452"),
    ("pipeline_bubble", "pipeline_bubble_seconds", "#937860"),
    ("optimizer", "optimizer_seconds", "#55a868"),
    ("host_other", "host_other_seconds", "#8c8c8c"),
)
MIN_LABELLED_SHARE = 0.06  # a segment under 6 % of the tallest bar is too thin for its number
MAX_PANELS_PER_ROW = 3


@dataclass(frozen=True, slots=True)
class JobFigures:
    """What a panel's title says about its job (from `plait top`'s figures)."""

    mfu: float | None  # None when no daemon reported the job's throughput
    step_seconds: float


def panel_title(job_id: str, ranks: Sequence[metrics_pb2.BottleneckBreakdown],
                figures: JobFigures | None) -> str:  # fmt: skip
    step = figures.step_seconds if figures else max(r.step_seconds for r in ranks)
    mfu = f"MFU {format_mfu(figures.mfu)}" if figures and figures.mfu is not None else "MFU n/a"
    # Two lines: a full job id (a UUID is 36 characters) beside the figures would run into
    # the next panel's title.
    return f"job {job_id}\n{mfu} · step {step * 1e3:.1f} ms"


def write_bottleneck_png(
    ranks: Sequence[metrics_pb2.BottleneckBreakdown],
    path: Path,
    jobs: Mapping[str, JobFigures] | None = None,
) -> None:
    """Stacked bars of mean ms per step in each class, one panel per job."""
    import matplotlib.pyplot as plt

    figure = bottleneck_figure(ranks, jobs)
    figure.savefig(path, dpi=100)
    plt.close(figure)


def bottleneck_figure(
    ranks: Sequence[metrics_pb2.BottleneckBreakdown], jobs: Mapping[str, JobFigures] | None = None
) -> Figure:
    """The figure `write_bottleneck_png` saves (close it with `plt.close`)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    by_job: dict[str, list[metrics_pb2.BottleneckBreakdown]] = {}
    for r in sorted(ranks, key=lambda r: (r.job_id, r.rank)):
        by_job.setdefault(r.job_id, []).append(r)
    panels = len(by_job)
    columns = min(panels, MAX_PANELS_PER_ROW)
    rows = -(-panels // columns)
    widths = [max(3.2, 0.75 * len(job_ranks) + 1.6) for job_ranks in by_job.values()]
    figure, axes_grid = plt.subplots(
        rows,
        columns,
        figsize=(sum(sorted(widths)[-columns:]) + 2.2, 4.2 * rows),
        squeeze=False,
    )
    used: set[str] = set()
    for index, (job_id, job_ranks) in enumerate(by_job.items()):
        axes = axes_grid[index // columns][index % columns]
        used |= _draw_panel(axes, job_ranks)
        axes.set_title(panel_title(job_id, job_ranks, (jobs or {}).get(job_id)), fontsize=9)
    for index in range(panels, rows * columns):
        axes_grid[index // columns][index % columns].axis("off")
    handles = [
        Patch(color=colour, label=CLASS_LABELS[name])
        for name, _, colour in SEGMENTS
        if name in used
    ]
    figure.legend(handles=handles, loc="center right", fontsize="small", title="ms per step")
    figure.tight_layout(rect=(0, 0, 1 - 1.6 / figure.get_figwidth(), 1))
    return figure


def _draw_panel(axes: Axes, ranks: Sequence[metrics_pb2.BottleneckBreakdown]) -> set[str]:
    """The bars of one job; returns the classes that have time in them (for the legend)."""
    labels = [f"rank {r.rank}" for r in ranks]
    totals = [sum(getattr(r, field) for _, field, _ in SEGMENTS) * 1e3 for r in ranks]
    tallest = max(totals, default=0.0) or 1.0
    bottom = [0.0] * len(ranks)
    used: set[str] = set()
    for name, field, colour in SEGMENTS:
        values = [getattr(r, field) * 1e3 for r in ranks]
        if not any(values):
            continue
        used.add(name)
        bars = axes.bar(labels, values, bottom=bottom, color=colour, edgecolor="white")
        for bar, value in zip(bars, values, strict=True):
            if value >= MIN_LABELLED_SHARE * tallest:
                axes.annotate(
                    f"{value:.1f}",
                    (bar.get_x() + bar.get_width() / 2, bar.get_y() + value / 2),
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                )
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for x, total in enumerate(totals):
        axes.annotate(f"{total:.1f} ms", (x, total), ha="center", va="bottom", fontsize=8,
                      xytext=(0, 2), textcoords="offset points")  # fmt: skip
    axes.set_ylim(0, tallest * 1.12)
    axes.set_ylabel("ms per step (mean)")
    return used
