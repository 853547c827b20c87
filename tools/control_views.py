"""What `plait profile`, `plait stacks` and `plait memory` print, and `--json` documents.

The figures come from the daemons (`plait.v1.Control` messages); this module only lays them
out: a capture's temporal breakdown per rank and the cross-rank verdict, the slowest rank's top
operators, stacks as Python prints tracebacks (innermost frame last), memory per rank, and the
ranks that did not answer, each with its reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.text import Text

from plait.daemon.job_reports import HostError
from plait.proto.plait.v1 import control_pb2
from plait.tools.daemon_tables import Column, build_table, format_bytes, milliseconds, percent

HANG_FRAMES = 8  # innermost frames of the training thread shown under a hang


def _share(seconds: float, r: control_pb2.RankTraceFigures) -> str:
    return percent(seconds / r.window_seconds) if r.window_seconds else "-"


def breakdown_columns() -> list[Column[control_pb2.RankTraceFigures]]:
    return [
        Column("rank", lambda r: str(r.rank), keep_empty=True),
        Column("host", lambda r: r.host, "left", wide_only=True),
        Column("timeline", lambda r: r.timeline, "left", wide_only=True),
        Column("steps", lambda r: str(r.steps)),
        Column("captured ms", lambda r: milliseconds(r.window_seconds), keep_empty=True),
        Column("compute %", lambda r: _share(r.compute_seconds, r), keep_empty=True),
        Column("comm %", lambda r: _share(r.communication_seconds, r), keep_empty=True),
        Column("memcpy %", lambda r: _share(r.memory_seconds, r)),
        Column("idle host %", lambda r: _share(r.idle_host_seconds, r), keep_empty=True),
        Column("idle peers %", lambda r: _share(r.idle_peer_wait_seconds, r), keep_empty=True),
        Column("overlap %", lambda r: percent(r.overlap_fraction), keep_empty=True),
        Column("launches", lambda r: str(r.launches) if r.launches else "-"),
        Column(
            "launch ms",
            lambda r: milliseconds(r.launch_cpu_seconds) if r.launches else "-",
            wide_only=True,
        ),
        Column(
            "launch delay µs",
            lambda r: f"{r.launch_delay_mean_seconds * 1e6:.0f}" if r.launches else "-",
            wide_only=True,
        ),
    ]


def top_op_columns() -> list[Column[control_pb2.TopOp]]:
    return [
        Column("operator", lambda o: o.name, "left", wraps=True, keep_empty=True),
        Column("class", lambda o: o.kind, "left"),
        Column("calls", lambda o: str(o.count)),
        Column("ms", lambda o: milliseconds(o.seconds), keep_empty=True),
    ]


def _rank_of(message: control_pb2.RankOutcome | control_pb2.RankStacks) -> str:
    """ "rank 3", or "group 1 rank 3" for a rank of a fault-tolerant job's replica group."""
    from plait.daemon.control_messages import replica_group_of
    from plait.daemon.control_records import rank_label

    return rank_label(replica_group_of(message), message.rank)


def _stacks_order(stacks: control_pb2.RankStacks) -> tuple[str, int, int]:
    from plait.daemon.control_messages import replica_group_of

    return (stacks.job_id, replica_group_of(stacks), stacks.rank)


def outcome_lines(outcomes: Sequence[control_pb2.RankOutcome]) -> list[Text]:
    return [
        Text(
            f"{_rank_of(o)}{f' ({o.host})' if o.host else ''}: {o.state}"
            + (f": {o.detail}" if o.detail else ""),
            style="yellow",
        )
        for o in outcomes
        if o.state != "delivered"
    ]


def error_lines(errors: Sequence[HostError]) -> list[Text]:
    return [Text(f"{host}: {error}", style="red") for host, error in errors]


def render_analysis(analysis: control_pb2.TraceAnalysis, width: int, top: int = 5) -> Group:
    parts: list[RenderableType] = [
        build_table(
            "time by class over the captured steps (HTA's temporal breakdown)",
            breakdown_columns(),
            analysis.ranks,
            width,
        )
    ]
    slowest = [r for r in analysis.ranks if r.rank == analysis.summary.slowest_rank]
    if slowest and slowest[0].top_ops:
        title = f"rank {slowest[0].rank}: top operators" + (
            " (kernel time)" if slowest[0].timeline == "cuda" else " (self time)"
        )
        parts.append(build_table(title, top_op_columns(), slowest[0].top_ops[:top], width))
    parts.append(Text(analysis.summary.verdict, style="bold"))
    return Group(*parts)


# --------------------------------------------------------------------------------------------
# stacks
# --------------------------------------------------------------------------------------------


def _frame_lines(frames: Sequence[control_pb2.StackFrame], indent: str) -> list[str]:
    lines = []
    for frame in frames:
        lines.append(f'{indent}File "{frame.file}", line {frame.line}, in {frame.function}')
        if frame.code:
            lines.append(f"{indent}  {frame.code.strip()}")
    return lines


def rank_header(stacks: control_pb2.RankStacks) -> str:
    header = f"{_rank_of(stacks)} · {stacks.host} · pid {stacks.pid} · step {stacks.step}"
    return header + "".join(f"\n  in collective: {op}" for op in stacks.in_flight)


def render_stacks(ranks: Sequence[control_pb2.RankStacks], *, all_threads: bool = True) -> Text:
    """Each rank's threads, the training thread first, frames as a traceback prints them."""
    text = Text()
    for stacks in sorted(ranks, key=_stacks_order):
        text.append(rank_header(stacks) + "\n", style="bold")
        for thread in stacks.threads:
            if not all_threads and not thread.training:
                continue
            role = " (training)" if thread.training else (" (daemon)" if thread.daemon else "")
            text.append(f"  thread {thread.name}{role}\n", style="cyan" if thread.training else "")
            text.append("\n".join(_frame_lines(thread.frames, "    ")) + "\n")
        text.append("\n")
    return text


def render_hang_stacks(ranks: Sequence[control_pb2.RankStacks]) -> Text:
    """Under a hang: where each rank of the group's training thread is (innermost frames)."""
    text = Text("stacks of the ranks in the hung collectives (innermost last):\n", style="red")
    for stacks in sorted(ranks, key=_stacks_order):
        text.append(rank_header(stacks) + "\n", style="bold")
        training = [t for t in stacks.threads if t.training] or list(stacks.threads[:1])
        for thread in training:
            text.append("\n".join(_frame_lines(thread.frames[-HANG_FRAMES:], "    ")) + "\n")
    return text


# --------------------------------------------------------------------------------------------
# memory
# --------------------------------------------------------------------------------------------


def _bytes(value: object) -> str:
    return format_bytes(float(value)) if isinstance(value, int | float) else "-"


def memory_columns() -> list[Column[tuple[int, dict]]]:
    """Rows: (rank, its memory report); a fault-tolerant job's reports carry their
    `replica_group` (the column is dropped when no row has one)."""

    def state(report: dict, key: str) -> object:
        return (report.get("model_state") or {}).get(key)

    return [
        Column("group", lambda r: str(r[1].get("replica_group", ""))),
        Column("rank", lambda r: str(r[0]), keep_empty=True),
        Column("step", lambda r: str(r[1].get("step", -1))),
        Column("RSS", lambda r: _bytes(r[1].get("rss_bytes")), keep_empty=True),
        Column("peak RSS", lambda r: _bytes(r[1].get("peak_rss_bytes"))),
        Column("parameters", lambda r: _bytes(state(r[1], "parameters"))),
        Column("gradients", lambda r: _bytes(state(r[1], "gradients"))),
        Column("optimizer", lambda r: _bytes(state(r[1], "optimizer_state"))),
        Column("activations", lambda r: _bytes(r[1].get("activations_saved_bytes"))),
        Column("CUDA allocated", lambda r: _bytes((r[1].get("cuda") or {}).get("allocated_bytes"))),
        Column("CUDA peak", lambda r: _bytes((r[1].get("cuda") or {}).get("peak_allocated_bytes"))),
        Column("note", lambda r: r[1].get("note", ""), "left", wraps=True, priority=0),
    ]
