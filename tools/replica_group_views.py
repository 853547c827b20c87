"""What `plait status` shows of fault-tolerant jobs: replica groups, quorum, events, lighthouse.

Each daemon answers for the ranks that report to it (`StatusResponse.fault_tolerant_jobs`) and
for the lighthouse it hosts (`StatusResponse.lighthouse`). Here the answers of several daemons
are merged per job — a group's ranks may report to several nodes' daemons — and rendered as
tables, or as the `fault_tolerance` and `lighthouses` keys of `plait status --json`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rich.markup import escape
from rich.table import Table
from rich.text import Text

from plait.daemon import json_documents as daemon_json
from plait.proto.plait.v1 import daemon_pb2

# A group's state across daemons: participating wins (a live rank anywhere), then finished.
_STATE_ORDER = ("participating", "finished", "left")
EVENT_COLUMNS = ("time", "group", "event", "step", "quorum", "groups", "took s", "detail")


@dataclass(frozen=True, slots=True)
class HostLighthouse:
    host: str  # the daemon that hosts it
    status: daemon_pb2.LighthouseStatus


def merge_fault_tolerant_jobs(
    answers: Sequence[daemon_pb2.StatusResponse],
) -> list[daemon_pb2.FaultTolerantJob]:
    """One message per job: groups merged by index, events merged and ordered by start."""
    by_job: dict[str, list[daemon_pb2.FaultTolerantJob]] = {}
    for answer in answers:
        for job in answer.fault_tolerant_jobs:
            by_job.setdefault(job.job_id, []).append(job)
    merged = []
    for job_id, jobs in sorted(by_job.items()):
        groups: dict[int, daemon_pb2.ReplicaGroupStatus] = {}
        for job in jobs:
            for group in job.groups:
                groups[group.replica_group] = _merge_group(groups.get(group.replica_group), group)
        events = {
            (e.start_unix_nano, e.replica_group, e.kind, e.quorum_id): e
            for job in jobs
            for e in job.events
        }
        latest = max(jobs, key=lambda j: j.quorum_id)
        merged.append(
            daemon_pb2.FaultTolerantJob(
                job_id=job_id,
                state=min((j.state for j in jobs), key=_job_state_rank),
                groups=[groups[index] for index in sorted(groups)],
                quorum_id=latest.quorum_id,
                participants=latest.participants,
                events=[events[key] for key in sorted(events)],
                events_received=sum(j.events_received for j in jobs),
            )
        )
    return merged


def _job_state_rank(state: str) -> int:
    order = ("running", "failed", "finished", "stale")
    return order.index(state) if state in order else len(order)


def _merge_group(
    seen: daemon_pb2.ReplicaGroupStatus | None, other: daemon_pb2.ReplicaGroupStatus
) -> daemon_pb2.ReplicaGroupStatus:
    if seen is None:
        return other
    last = seen if (seen.quorum_id, seen.step) >= (other.quorum_id, other.step) else other
    return daemon_pb2.ReplicaGroupStatus(
        replica_group=seen.replica_group,
        state=min((seen.state, other.state), key=_group_state_rank),
        ranks=sorted(set(seen.ranks) | set(other.ranks)),
        ranks_live=seen.ranks_live + other.ranks_live,
        step=max(seen.step, other.step),
        replica_id=last.replica_id or seen.replica_id or other.replica_id,
        quorum_id=last.quorum_id,
        participants=last.participants,
        world_size=max(seen.world_size, other.world_size),
        restarts=max(seen.restarts, other.restarts),
    )


def _group_state_rank(state: str) -> int:
    return _STATE_ORDER.index(state) if state in _STATE_ORDER else len(_STATE_ORDER)


def lighthouses(hosts: Sequence[tuple[str, daemon_pb2.StatusResponse]]) -> list[HostLighthouse]:
    return [HostLighthouse(host, s.lighthouse) for host, s in hosts if s.HasField("lighthouse")]


# --------------------------------------------------------------------------------------------
# text
# --------------------------------------------------------------------------------------------


def _time_of_day(unix_nano: int) -> str:
    seconds = unix_nano / 1e9
    return time.strftime("%H:%M:%S", time.localtime(seconds)) + f".{int(seconds % 1 * 1000):03d}"


def render_fault_tolerance(
    jobs: Sequence[daemon_pb2.FaultTolerantJob],
    houses: Sequence[HostLighthouse],
    names: Mapping[str, str],
) -> list[Table]:
    """A replica-group table and an event table per job, a table per hosted lighthouse.

    Job ids, replica ids, addresses and errors come from the daemons: escaped in titles (rich
    markup), plain `Text` in cells, so their brackets show as they are."""
    tables = []
    for job in jobs:
        name = escape(names.get(job.job_id, job.job_id))
        quorum = f"quorum {job.quorum_id}" if job.quorum_id >= 0 else "no quorum yet"
        groups = Table(
            title=f"replica groups of {name} ({job.state}; {quorum}, "
            f"{job.participants} participating)"
        )
        for column in ("group", "state", "ranks", "live", "step", "quorum", "replica id"):
            groups.add_column(column)
        for g in job.groups:
            groups.add_row(
                str(g.replica_group),
                Text.assemble((g.state, "" if g.state == "participating" else "red")),
                ",".join(map(str, g.ranks)) or "-",
                str(g.ranks_live),
                str(g.step),
                f"{g.quorum_id} ({g.participants} groups)" if g.quorum_id >= 0 else "-",
                Text(g.replica_id or "-"),
            )
        tables.append(groups)
        if job.events:
            events = Table(title=f"quorum events of {name} (oldest first)")
            for column in (
                "time",
                "group",
                "event",
                "step",
                "quorum",
                "groups",
                "took s",
                "detail",
            ):
                events.add_column(column)
            for e in job.events:
                events.add_row(
                    _time_of_day(e.start_unix_nano),
                    str(e.replica_group),
                    Text(e.kind),
                    str(e.step),
                    str(e.quorum_id),
                    f"{e.previous} -> {e.participants}",
                    f"{e.seconds:.2f}",
                    Text(e.detail or "-"),
                )
            tables.append(events)
    for house in houses:
        status = house.status
        title = f"lighthouse {escape(status.address)} on {escape(house.host)}"
        if status.error:
            title += f": [red]not read ({escape(status.error)})[/red]"
        else:
            title += f" (quorum {status.quorum_id}, {status.waiting} waiting for the next)"
        table = Table(title=title)
        for column in ("job", "group", "replica id", "heartbeat age s"):
            table.add_column(column)
        for beat in status.heartbeats:
            table.add_row(
                Text(names.get(beat.job_id, beat.job_id) or "-"),
                str(beat.replica_group) if beat.replica_group >= 0 else "-",
                Text(beat.replica_id),
                f"{beat.age_seconds:.1f}",
            )
        tables.append(table)
    return tables


# --------------------------------------------------------------------------------------------
# --json
# --------------------------------------------------------------------------------------------


def fault_tolerance_document(
    jobs: Sequence[daemon_pb2.FaultTolerantJob], houses: Sequence[HostLighthouse]
) -> dict[str, list[dict]]:
    return {
        "fault_tolerance": [daemon_json.message_dict(job) for job in jobs],
        "lighthouses": [{"host": h.host, **daemon_json.message_dict(h.status)} for h in houses],
    }
