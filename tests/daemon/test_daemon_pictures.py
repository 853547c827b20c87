"""The pictures a person reads at a glance: `plait bottleneck --png` and `plait schedule --png`.

Read back from the matplotlib figure the PNG is saved from: its panels, titles, the numbers
written on the bars, the legend.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pytest

from plait.plugins.pipeline.schedules import build_programs
from plait.plugins.pipeline.timeline import (
    INCHES_PER_UNIT,
    MAX_ROW_INCHES,
    format_action,
    simulate_timeline,
    timeline_figure,
)
from plait.proto.plait.v1 import metrics_pb2
from plait.tools.daemon_pictures import JobFigures, bottleneck_figure

JOB_A = "3f2b9c1e-8d4a-4f6b-9a2e-7c1d5e8f0a11"
JOB_B = "3f2b9c1e-52aa-4c0d-8e11-90ab34cd12ef"


def breakdown(job_id: str, rank: int, compute: float, comm: float, bubble: float = 0.0):
    return metrics_pb2.BottleneckBreakdown(
        job_id=job_id, rank=rank, steps=20, compute_seconds=compute, exposed_comm_seconds=comm,
        pipeline_bubble_seconds=bubble, optimizer_seconds=0.02, host_other_seconds=0.01,
        step_seconds=compute + comm + bubble + 0.03,
    )  # fmt: skip


@pytest.fixture
def figures():
    opened = []

    def keep(figure):
        opened.append(figure)
        return figure

    yield keep
    for figure in opened:
        plt.close(figure)


def visible_axes(figure) -> list:
    return [axes for axes in figure.axes if axes.axison]


def texts(axes) -> list[str]:
    return [text.get_text() for text in axes.texts]


def test_bottleneck_picture_one_titled_panel_per_job_with_values_on_the_bars(figures) -> None:
    ranks = [
        breakdown(JOB_A, 0, 0.25, 0.2205),
        breakdown(JOB_A, 1, 0.27, 0.21),
        *(breakdown(JOB_B, rank, 0.08, 0.012, bubble=0.03) for rank in range(4)),
    ]
    jobs = {JOB_A: JobFigures(mfu=0.041, step_seconds=0.5105), JOB_B: JobFigures(None, 0.142)}
    figure = figures(bottleneck_figure(ranks, jobs))
    panels = visible_axes(figure)
    assert len(panels) == 2  # one per job, so full ids never share an axis as labels
    b, a = sorted(panels, key=lambda axes: JOB_A in axes.get_title())
    assert JOB_A in a.get_title() and "MFU 4.1%" in a.get_title()
    assert "step 510.5 ms" in a.get_title()
    assert JOB_B in b.get_title() and "MFU n/a" in b.get_title()
    assert [t.get_text() for t in a.get_xticklabels()] == ["rank 0", "rank 1"]
    assert [t.get_text() for t in b.get_xticklabels()] == [f"rank {r}" for r in range(4)]
    # Segment values in ms (those tall enough to hold them) and each bar's total.
    assert {"250.0", "220.5", "270.0", "210.0"} <= set(texts(a))
    assert {"500.5 ms", "510.0 ms"} <= set(texts(a))
    assert "30.0" in texts(b) and "80.0" in texts(b)
    assert "20.0" not in texts(a)  # 20 ms of optimizer is under 6 % of a 510 ms bar
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "compute", "exposed comm", "bubble", "optimizer", "host/other",
    ]  # fmt: skip


def test_bottleneck_picture_legend_leaves_out_classes_with_no_time(figures) -> None:
    figure = figures(bottleneck_figure([breakdown("j", 0, 0.05, 0.0)]))
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["compute", "optimizer", "host/other"]
    assert "job j" in visible_axes(figure)[0].get_title()


def test_schedule_picture_wraps_long_timelines_and_names_chunk_shading(figures) -> None:
    programs = build_programs(
        "interleaved_1f1b", num_microbatches=16, num_stages=4, virtual_stages=2
    )
    timeline = simulate_timeline(programs, num_stages=4, virtual_stages=2)
    assert timeline.makespan == pytest.approx(105)  # 31.5 inches at one row
    figure = figures(timeline_figure(timeline, title="interleaved"))
    rows = visible_axes(figure)
    assert len(rows) == 3
    width, _ = figure.get_size_inches()
    assert width <= MAX_ROW_INCHES + 3.5
    spans = [axes.get_xlim() for axes in rows]
    assert spans[0][0] == 0 and all(hi - lo == spans[0][1] for lo, hi in spans)
    assert spans[0][1] * INCHES_PER_UNIT <= MAX_ROW_INCHES
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "forward",
        "backward",
        "model chunk 0 (as F0)",
        "model chunk 1 (as F0.1, lighter)",
        "idle (bubble)",
    ]
    labels = {text for axes in rows for text in texts(axes)}
    actions = {format_action(t.action) for row in timeline.rows.values() for t in row}
    # Every forward and backward is labelled in some row (a part cut by a row's end may not be).
    assert {a for a in actions if a[0] in "FB"} <= labels


def test_short_schedule_picture_is_one_row_without_chunk_entries(figures) -> None:
    programs = build_programs("1f1b", num_microbatches=4, num_stages=2)
    figure = figures(timeline_figure(simulate_timeline(programs, num_stages=2)))
    assert len(visible_axes(figure)) == 1
    (legend,) = figure.legends
    assert [t.get_text() for t in legend.get_texts()] == ["forward", "backward", "idle (bubble)"]
