"""The daemon commands' tables at 80 and 200 columns: what is dropped, shortened and kept."""

from __future__ import annotations

import pytest
from rich.console import Console

from plait.daemon.job_reports import JobVerdict
from plait.proto.plait.v1 import daemon_pb2, metrics_pb2
from plait.tools.daemon_tables import NARROW_WIDTH, short_job_ids
from plait.tools.daemon_views import (
    BottleneckView,
    DaemonRow,
    StatusView,
    TopView,
    render_top,
)

# Two jobs whose UUIDs share their first eight characters, two CPU ranks each.
JOB_A = "3f2b9c1e-8d4a-4f6b-9a2e-7c1d5e8f0a11"
JOB_B = "3f2b9c1e-52aa-4c0d-8e11-90ab34cd12ef"
UNREACHABLE = ("10.0.0.9:7070", "UNAVAILABLE: failed to connect to all addresses; ipv4:10.0.0.9")


def rank_metrics(job_id: str, rank: int) -> metrics_pb2.RankMetrics:
    # A CPU rank: no device memory gauge, no GPU utilisation, no process figures yet.
    return metrics_pb2.RankMetrics(
        job_id=job_id, rank=rank, host="node-a", step=41, window_steps=20, step_seconds=0.2231,
        tokens_per_second=12_345.0, mfu=0.0412, comm_share=0.31, data_wait_seconds=0.0042,
        cpu_percent=-1.0, memory_rss_bytes=-1, device_memory_bytes=-1, device_utilization=-1.0,
    )  # fmt: skip


def metrics_response() -> daemon_pb2.GetMetricsResponse:
    jobs = [
        metrics_pb2.JobMetrics(
            job_id=job_id,
            world_size=2,
            ranks_reporting=2,
            step=41,
            step_seconds=0.2231,
            tokens_per_second=24_690.0,
            model_flops_per_second=2e11,
            peak_flops=5e12,
        )
        for job_id in (JOB_A, JOB_B)
    ]
    host = metrics_pb2.HostMetrics(
        hostname="node-a", cpu_percent=97.0, cpu_count=2, memory_used_bytes=3 * 2**30,
        memory_total_bytes=24 * 2**30, net_sent_bytes_per_second=2048.0,
        net_recv_bytes_per_second=1024.0,
    )  # fmt: skip
    ranks = [rank_metrics(job, rank) for job in (JOB_A, JOB_B) for rank in (0, 1)]
    return daemon_pb2.GetMetricsResponse(ranks=ranks, jobs=jobs, host=host)


def printed(renderable: object, width: int) -> list[str]:
    console = Console(width=width, record=True, color_system=None)
    console.print(renderable)
    return console.export_text().splitlines()


def assert_whole_tables(lines: list[str], width: int) -> None:
    """Every table fits `width` and is drawn whole: closed on the right, no column squeezed
    to nothing (what rich does to a table wider than the terminal)."""
    assert max(len(line) for line in lines) <= width
    rows = [line.rstrip() for line in lines if line[:1] in "┏┃┡│└"]
    assert all(line[-1] in "┓┃┩│┘" for line in rows), "\n".join(lines)
    assert not [line for line in rows if "┳┳" in line or "┃┃" in line], "\n".join(lines)


def header_cells(lines: list[str]) -> list[str]:
    return [cell.strip() for line in lines if line.startswith("┃") for cell in line.split("┃")]


def test_short_job_ids_tell_jobs_apart_by_head_or_tail() -> None:
    uuids = short_job_ids([JOB_A, JOB_B], width=80)
    assert len(set(uuids.values())) == 2 and all(len(v) < 12 for v in uuids.values())
    # Default ids made of a config name and a start time differ only at their end.
    stamped = ["tiny-llama-20261122-231501", "tiny-llama-20261122-234512"]
    labels = short_job_ids(stamped, width=80)
    assert len(set(labels.values())) == 2 and all("…" in v for v in labels.values())
    assert short_job_ids(["job-a", *stamped], width=80)["job-a"] == "job-a"
    assert short_job_ids([JOB_A], width=NARROW_WIDTH) == {JOB_A: JOB_A}


def test_top_at_80_columns_fits_and_keeps_what_matters() -> None:
    lines = printed(TopView.from_latest({"127.0.0.1:7070": metrics_response()}).render(80), 80)
    text = "\n".join(lines)
    assert_whole_tables(lines, 80)
    headers = header_cells(lines)
    assert not [h for h in headers if "…" in h], headers  # no header cut into "tok…"
    for wanted in ("tokens/s", "step ms", "MFU"):
        assert headers.count(wanted) == 2, wanted  # the jobs table's and the ranks'
    for wanted in ("comm %", "data ms", "memory GiB"):
        assert wanted in headers
    # Columns no CPU rank fills are gone; so is the host column (one host, named below).
    assert "GPU %" not in headers and "memory" not in headers
    assert headers.count("CPU %") == 1  # the hosts table's, not the ranks'
    labels = short_job_ids([JOB_A, JOB_B], 80)
    assert JOB_A not in text and all(text.count(label) == 3 for label in labels.values())
    rows = [line for line in lines if line.startswith("│") and labels[JOB_A] in line]
    cells = [cell.strip() for cell in rows[1].split("│")[2:9]]  # rank 0 of job A
    assert cells == ["0", "41", "12,345", "4.1%", "223.1", "31", "4.2"]


def test_top_at_200_columns_shows_every_column_and_full_ids() -> None:
    lines = printed(render_top({"127.0.0.1:7070": metrics_response()}, width=200), 200)
    headers = header_cells(lines)
    for wanted in ("host", "GPU %", "memory", "CPU %", "net out/s"):
        assert wanted in headers
    text = "\n".join(lines)
    assert JOB_A in text and JOB_B in text and "node-a (127.0.0.1:7070)" in text


@pytest.mark.parametrize("width", [80, 200])
def test_a_host_that_did_not_answer_is_a_line_under_the_tables(width: int) -> None:
    latest = {"127.0.0.1:7070": metrics_response(), UNREACHABLE[0]: UNREACHABLE[1]}
    lines = printed(TopView.from_latest(latest).render(width), width)
    (line,) = [line for line in lines if UNREACHABLE[0] in line]
    assert line.strip() == f"{UNREACHABLE[0]}: {UNREACHABLE[1]}"  # whole, outside any cell
    status = StatusView(
        daemons=[DaemonRow("127.0.0.1:7070", daemon_pb2.StatusResponse(version="1", ranks=2))],
        ranks=[],
        hangs=[],
        errors=[UNREACHABLE],
    )
    lines = printed(status.render(width), width)
    assert f"{UNREACHABLE[0]}: {UNREACHABLE[1]}" in [line.strip() for line in lines]
    assert not [line for line in lines if line.startswith("│") and "UNAVAILABLE" in line]


def bottleneck_view() -> BottleneckView:
    ranks = [
        metrics_pb2.BottleneckBreakdown(
            job_id=JOB_A,
            rank=rank,
            steps=20,
            step_seconds=0.5,
            compute_seconds=0.25,
            exposed_comm_seconds=0.2205,
            data_wait_seconds=0.0095,
            optimizer_seconds=0.01,
            host_other_seconds=0.01,
            dominant="compute",
        )
        for rank in (0, 1)
    ]
    verdict = JobVerdict(JOB_A, "compute", "compute-bound (50% of the step): the healthy case")
    return BottleneckView(ranks, [], 0.2, [verdict], [])


def test_bottleneck_at_80_columns_drops_classes_nobody_spends_time_in() -> None:
    narrow = printed(bottleneck_view().render(80), 80)
    assert_whole_tables(narrow, 80)
    headers = header_cells(narrow)
    assert "bubble" not in headers and "steps" not in headers and "job" not in headers
    assert {"rank", "step ms", "compute", "comm", "data", "optim", "other"} <= set(headers)
    assert any(line.startswith("│") and "220.5" in line for line in narrow)
    wide = header_cells(printed(bottleneck_view().render(200), 200))
    assert "bubble" in wide and "job" in wide and "steps" in wide
    verdict = [line for line in printed(bottleneck_view().render(80), 80) if "job " in line]
    assert verdict and "healthy case" in " ".join(verdict)


def test_status_at_80_columns_drops_low_priority_columns_instead_of_cutting_them() -> None:
    ranks = [
        metrics_pb2.RankInfo(
            job_id=job_id,
            rank=rank,
            world_size=2,
            host="node-a",
            pid=4242,
            device="cuda:0",
            device_name="NVIDIA H100 80GB HBM3",
            compute_dtype="bfloat16",
            peak_flops=989e12,
            peak_flops_source="table: NVIDIA H100 SXM (bfloat16 dense)",
            steps_received=120,
            coordinates={"dp": rank, "tp": 0, "pp": 0, "cp": 0},
        )
        for job_id in (JOB_A, JOB_B)
        for rank in (0, 1)
    ]
    state = daemon_pb2.StatusResponse(
        version="0.1.0", ranks=4, job_ids=[JOB_A, JOB_B], gpu_collector="NVML: 8 GPUs"
    )
    view = StatusView([DaemonRow("10.0.0.1:7070", state)], ranks, [], [])
    narrow = printed(view.render(80), 80)
    assert_whole_tables(narrow, 80)
    headers = header_cells(narrow)
    assert not [h for h in headers if "…" in h], headers
    assert {"job", "rank", "device", "peak TFLOP/s", "steps"} <= set(headers)
    assert "mesh" not in headers and "pid" not in headers  # gone to fit, not cut to "me…"
    assert not [line for line in narrow if "…" in line and "3f2b…" not in line]
    wide = printed(view.render(200), 200)
    assert_whole_tables(wide, 200)
    wide_headers = header_cells(wide)
    assert {"mesh", "pid", "device name", "peak from", "dtype"} <= set(wide_headers)
    assert "NVIDIA H100" in "\n".join(wide)  # free text wraps inside its cell
