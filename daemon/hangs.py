"""Hang detection: a collective that some ranks of its group entered and the others have not.

Ranks do not say "I entered op k" on the hot path. The telemetry plugin keeps, per rank, the
ops issued but not completed and the last sequence number issued on every group; a separate
short-interval metric reader (`plait.plugins.telemetry.heartbeat`) publishes them as
three OTLP gauges, read in a background thread:

* `plait.comm.heartbeat` — always present: this export is a heartbeat (replaces the last one);
* `plait.comm.inflight` — one point per op in flight (group, ranks, op, seq, purpose), value =
  the op's start time in Unix seconds;
* `plait.comm.entered` — one point per group, value = the last sequence number issued on it.

A rank blocked in all-reduce seq k keeps heartbeating (the reader thread runs while the
collective waits), while the rank that never arrived reports `entered < k`. When the oldest
in-flight op of a group has waited longer than the timeout, the daemon reports it with the ranks
that entered it, the ranks reporting here that have not (`missing`), and the group's ranks this
daemon does not see (`unreported`: on another node; the CLI merges daemons). Point-to-point ops
are left out: a recv waiting on a send is a pipeline bubble, not a group hang.

A fault-tolerant job's replica groups are worlds of their own (their ranks and comm groups are
numbered within the group): ops are matched within a replica group, and a report names the
group of the hung ranks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from plait.daemon import telemetry_schema as names
from plait.daemon.config import DEFAULT_HANG_TIMEOUT_SECONDS

if TYPE_CHECKING:  # the daemon's decoder: the CLI merges hangs without it
    from plait.daemon.decoder import GaugePoint

# A rank whose last heartbeat is older than this no longer vouches for its in-flight ops
# (its process is gone); its ops stop producing reports, and it counts as not having entered.
HEARTBEAT_STALE_SECONDS = 30.0
POINT_TO_POINT = frozenset({"send", "recv"})

GroupKey = tuple[str, tuple[int, ...]]  # (group name, global ranks)
HangRankKey = tuple[str, int, int]  # (job id, replica group or -1, rank)


@dataclass(frozen=True, slots=True)
class InflightOp:
    group: str
    group_ranks: tuple[int, ...]
    op: str
    seq: int
    purpose: str
    start_ns: int

    @property
    def group_key(self) -> GroupKey:
        return (self.group, self.group_ranks)


@dataclass(frozen=True, slots=True)
class Heartbeat:
    received_ns: int
    inflight: tuple[InflightOp, ...] = ()
    entered: dict[GroupKey, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Hang:
    job_id: str
    group: str
    group_ranks: tuple[int, ...]
    op: str
    seq: int
    purpose: str
    entered_ranks: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    unreported_ranks: tuple[int, ...]
    entered_ns: int
    waiting_seconds: float
    replica_group: int = -1  # the hung ranks' replica group in a fault-tolerant job

    @property
    def key(self) -> tuple[str, int, str, tuple[int, ...], int]:
        return (self.job_id, self.replica_group, self.group, self.group_ranks, self.seq)

    def describe(self) -> str:
        missing = list(self.missing_ranks) + [f"{r}?" for r in self.unreported_ranks]
        job = f"job {self.job_id}"
        if self.replica_group >= 0:
            job += f" replica group {self.replica_group}"
        return (
            f"{job}: {self.op} seq {self.seq} on group {self.group!r} "
            f"{list(self.group_ranks)} waiting {self.waiting_seconds:.1f}s; entered "
            f"{list(self.entered_ranks)}, missing {missing}"
        )


def heartbeat_from_points(points: Iterable[GaugePoint], received_ns: int) -> Heartbeat | None:
    """A heartbeat from one metrics export's decoded heartbeat gauges, if it holds one."""
    points = list(points)
    if not any(p.name == names.METRIC_COMM_HEARTBEAT for p in points):
        return None
    inflight: list[InflightOp] = []
    entered: dict[GroupKey, int] = {}
    for point in points:
        if point.name == names.METRIC_COMM_INFLIGHT:
            inflight.append(
                InflightOp(
                    group=point.group,
                    group_ranks=point.group_ranks,
                    op=point.op,
                    seq=point.seq,
                    purpose=point.purpose,
                    start_ns=int(point.value * 1e9),
                )
            )
        elif point.name == names.METRIC_COMM_ENTERED:
            entered[(point.group, point.group_ranks)] = int(point.value)
    return Heartbeat(received_ns=received_ns, inflight=tuple(inflight), entered=entered)


def find_hangs(
    heartbeats: Mapping[HangRankKey, Heartbeat | None],
    *,
    now_ns: int,
    timeout_seconds: float = DEFAULT_HANG_TIMEOUT_SECONDS,
    stale_seconds: float = HEARTBEAT_STALE_SECONDS,
) -> list[Hang]:
    """Collectives in flight longer than `timeout_seconds` that not every rank has entered.

    `heartbeats` maps (job id, replica group, rank) to the rank's last heartbeat (None: the
    rank reports here but has sent none, e.g. an older plait).
    """
    fresh = {
        key: beat
        for key, beat in heartbeats.items()
        if beat is not None and (now_ns - beat.received_ns) / 1e9 <= stale_seconds
    }
    known: dict[tuple[str, int], set[int]] = {}
    for job_id, replica_group, rank in heartbeats:
        known.setdefault((job_id, replica_group), set()).add(rank)
    # The oldest waiting op per (job, replica group, comm group): later ops wait behind it.
    oldest: dict[tuple[str, int, GroupKey], InflightOp] = {}
    for (job_id, replica_group, _), beat in fresh.items():
        for op in beat.inflight:
            if op.op in POINT_TO_POINT or (now_ns - op.start_ns) / 1e9 < timeout_seconds:
                continue
            key = (job_id, replica_group, op.group_key)
            current = oldest.get(key)
            if current is None or (op.seq, op.start_ns) < (current.seq, current.start_ns):
                oldest[key] = op
    hangs: list[Hang] = []
    for (job_id, replica_group, group_key), op in sorted(oldest.items(), key=lambda kv: kv[0]):
        entered, missing, unreported = [], [], []
        first_ns = op.start_ns
        for rank in op.group_ranks:
            beat = fresh.get((job_id, replica_group, rank))
            if rank not in known.get((job_id, replica_group), set()):
                unreported.append(rank)
            elif beat is not None and beat.entered.get(group_key, -1) >= op.seq:
                entered.append(rank)
                for other in beat.inflight:
                    if other.group_key == group_key and other.seq == op.seq:
                        first_ns = min(first_ns, other.start_ns)
            else:
                missing.append(rank)
        if not missing and not unreported:
            continue  # every rank is in the op: slow or stuck transport, not a missing rank
        hangs.append(
            Hang(
                job_id=job_id,
                group=op.group,
                group_ranks=op.group_ranks,
                op=op.op,
                seq=op.seq,
                purpose=op.purpose,
                entered_ranks=tuple(entered),
                missing_ranks=tuple(missing),
                unreported_ranks=tuple(unreported),
                entered_ns=first_ns,
                waiting_seconds=(now_ns - first_ns) / 1e9,
                replica_group=replica_group,
            )
        )
    return hangs


def merge_hangs(reports: Iterable[Hang]) -> list[Hang]:
    """Combine the reports of several daemons for the same collective (the CLI's view).

    A rank entered if any daemon saw it enter; it is missing if a daemon that sees it says so,
    and unreported only if no daemon sees it at all.
    """
    by_key: dict[tuple[str, int, str, tuple[int, ...], int], list[Hang]] = {}
    for hang in reports:
        by_key.setdefault(hang.key, []).append(hang)
    merged: list[Hang] = []
    for key, hangs in sorted(by_key.items()):
        entered = set().union(*(h.entered_ranks for h in hangs))
        missing = set().union(*(h.missing_ranks for h in hangs)) - entered
        seen = entered | missing
        unreported = set.intersection(*(set(h.unreported_ranks) for h in hangs)) - seen
        first = min(hangs, key=lambda h: h.entered_ns)
        merged.append(
            Hang(
                job_id=key[0],
                group=first.group,
                group_ranks=first.group_ranks,
                op=first.op,
                seq=first.seq,
                purpose=first.purpose,
                entered_ranks=tuple(sorted(entered)),
                missing_ranks=tuple(sorted(missing)),
                unreported_ranks=tuple(sorted(unreported)),
                entered_ns=first.entered_ns,
                waiting_seconds=max(h.waiting_seconds for h in hangs),
                replica_group=first.replica_group,
            )
        )
    return [h for h in merged if h.missing_ranks or h.unreported_ranks]
