"""The control channel's records: what ranks say, what they are asked, what became of it.

Plain frozen dataclasses and the planning arithmetic, shared by the daemon's registry
(`plait.daemon.control`), its gRPC translation and the CLI (which plans one start step for
several daemons). No gRPC types.

A rank is addressed by (job, replica group, rank): a fault-tolerant job runs several replica
groups, each its own world with ranks 0..n-1 under one job id, so two groups' rank 0 on one node
are two endpoints. An ordinary job's ranks are in no group (`NO_REPLICA_GROUP`).
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from plait.daemon.telemetry_schema import NO_REPLICA_GROUP

DEFAULT_MAX_RANK_BYTES = 64 * 2**20
DEFAULT_MAX_CAPTURES = 2

PROFILE, STACKS, MEMORY, CANCEL = "profile", "stacks", "memory", "cancel"
CAPTURE_KINDS = (PROFILE, MEMORY)  # the kinds limited in concurrency
MAX_REPLANS = 2  # fresh start steps after a miss before the missing rank is given up
RATE_WINDOW_SECONDS = 30.0  # step samples kept per rank for its rate
MAX_STEP = 2**63 - 2  # as the span decoder bounds steps (`plait.daemon.decoder.MAX_WIRE_STEP`)

# Outcome states, as `RankOutcome.state` carries them.
DELIVERED = "delivered"
NOT_POLLING = "not polling"
LEFT = "left"
NOT_READY = "not ready"
MISSED = "missed start"
TIMED_OUT = "timed out"
FAILED = "failed"
OVER_LIMIT = "over limit"
REJECTED = "rejected"
UNKNOWN_RANK = "unknown rank"
TERMINAL = frozenset(
    {DELIVERED, NOT_POLLING, LEFT, NOT_READY, MISSED, TIMED_OUT, FAILED, OVER_LIMIT, REJECTED,
     UNKNOWN_RANK}
)  # fmt: skip


class RankAddress(NamedTuple):
    """A rank within a job: its replica group (`NO_REPLICA_GROUP` in an ordinary job) and its
    rank in that group's world. Sorts by group, then rank."""

    replica_group: int
    rank: int


def rank_label(replica_group: int, rank: int) -> str:
    """ "rank 3", or "group 1 rank 3" in a fault-tolerant job."""
    if replica_group == NO_REPLICA_GROUP:
        return f"rank {rank}"
    return f"group {replica_group} rank {rank}"


def rank_file_prefix(replica_group: int, rank: int) -> str:
    """ "rank3", or "group1.rank3" for a rank of a replica group: the start of the names of the
    files a rank's answer is kept in (two groups' rank 3 write different files)."""
    if replica_group == NO_REPLICA_GROUP:
        return f"rank{rank}"
    return f"group{replica_group}.rank{rank}"


class Refusal(Exception):
    """An operator's request the daemon will not start; `code` names the kind of reason
    ("not_found", "failed_precondition", "resource_exhausted", "invalid_argument")."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class ControlLimits:
    """What the daemon allows through the control channel."""

    # A rank that has not polled for this long is not polling (a busy exporter thread may
    # miss a few half-second polls while it uploads a trace).
    poll_patience_seconds: float = 10.0
    max_steps: int = 100
    max_seconds: float = 300.0
    max_rank_bytes: int = DEFAULT_MAX_RANK_BYTES  # one rank's compressed delivery
    max_request_bytes: int = 256 * 2**20  # all ranks of one request together
    max_captures: int = DEFAULT_MAX_CAPTURES  # profiles and memory snapshots in progress at once
    max_chunk_bytes: int = 2**20
    default_timeout_seconds: float = 120.0
    prepare_timeout_seconds: float = 60.0
    # A prepared profile waits this long for its collect call (the CLI asks at once).
    prepared_ttl_seconds: float = 120.0
    stacks_timeout_seconds: float = 10.0
    memory_step_wait_seconds: float = 10.0
    # How far ahead a start step is planned: a poll interval or two for the order to arrive.
    plan_lookahead_seconds: float = 2.0

    def __post_init__(self) -> None:
        for name in ("max_steps", "max_captures", "max_chunk_bytes", "max_rank_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"control {name} must be >= 1, got {getattr(self, name)}")
        if self.max_request_bytes < self.max_rank_bytes:
            raise ValueError("control max_request_bytes must be >= max_rank_bytes")
        for name in ("poll_patience_seconds", "max_seconds", "default_timeout_seconds"):
            if not getattr(self, name) > 0:
                raise ValueError(f"control {name} must be > 0, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class RankHello:
    """What a rank says in each poll."""

    job_id: str
    rank: int
    world_size: int = 1
    host: str = ""
    pid: int = 0
    device: str = "cpu"
    coordinates: Mapping[str, int] = field(default_factory=dict)
    step: int = -1
    clock_offset_ns: int = 0
    clock_rtt_ns: int = 0
    busy: tuple[str, ...] = ()  # "request_id:plan" of orders it works on
    ready: tuple[str, ...] = ()  # request ids whose profiler is ready
    leaving: bool = False
    replica_group: int = NO_REPLICA_GROUP

    @property
    def address(self) -> RankAddress:
        return RankAddress(self.replica_group, self.rank)

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.job_id, self.replica_group, self.rank)


@dataclass(frozen=True, slots=True)
class ProfileSpec:
    steps: int = 0  # 0: `seconds` decides, on the rank
    seconds: float = 0.0
    with_stack: bool = False
    record_shapes: bool = False


@dataclass(frozen=True, slots=True)
class Order:
    """Something a rank is asked to do (one poll response carries several)."""

    request_id: str
    kind: str
    plan: int = 0
    start_step: int = -1
    profile: ProfileSpec | None = None
    max_bytes: int = 0
    step_wait_seconds: float = 0.0
    reason: str = ""  # of a cancel

    @property
    def ack(self) -> str:
        return f"{self.request_id}:{self.plan}"


@dataclass
class Endpoint:
    """One rank reachable through the channel, as of its last poll."""

    hello: RankHello
    first_poll_ns: int
    last_poll_ns: int
    steps: deque[tuple[int, int]] = field(default_factory=deque)  # (poll ns, step)
    pending: list[Order] = field(default_factory=list)
    left_ns: int = 0

    def record(self, hello: RankHello, now_ns: int) -> None:
        self.hello, self.last_poll_ns = hello, now_ns
        if hello.step >= 0 and (not self.steps or self.steps[-1][1] != hello.step):
            self.steps.append((now_ns, hello.step))
        while self.steps and now_ns - self.steps[0][0] > RATE_WINDOW_SECONDS * 1e9:
            self.steps.popleft()

    def steps_per_second(self) -> float:
        """The fastest rate between two recent step samples (0: not known). The fastest, not
        the mean: a start step planned from a rate that is too slow comes too soon."""
        best = 0.0
        for (t0, s0), (t1, s1) in itertools.pairwise(self.steps):
            if t1 > t0 and s1 > s0:
                best = max(best, (s1 - s0) / ((t1 - t0) / 1e9))
        return best

    def polling(self, now_ns: int, patience_seconds: float) -> bool:
        return not self.left_ns and (now_ns - self.last_poll_ns) / 1e9 <= patience_seconds


@dataclass(frozen=True, slots=True)
class EndpointView:
    """An endpoint as reported to operators (a copy taken under the lock)."""

    hello: RankHello
    last_poll_ns: int
    steps_per_second: float
    polling: bool
    left: bool


@dataclass(frozen=True, slots=True)
class Outcome:
    job_id: str
    rank: int
    host: str
    state: str
    detail: str = ""
    last_poll_ns: int = 0
    replica_group: int = NO_REPLICA_GROUP

    @property
    def address(self) -> RankAddress:
        return RankAddress(self.replica_group, self.rank)


@dataclass
class RankDelivery:
    """One addressed rank's progress on a request."""

    rank: int
    host: str
    state: str = "asked"  # asked, ready, asked to start, delivering, or a terminal state
    detail: str = ""
    plan: int = 0
    parts: dict[str, bytearray] = field(default_factory=dict)
    received_bytes: int = 0
    next_index: int = 0
    first_step: int = -1
    last_step: int = -1
    clock_offset_ns: int = 0
    clock_rtt_ns: int = 0
    expected_bytes: int = 0
    replica_group: int = NO_REPLICA_GROUP

    @property
    def address(self) -> RankAddress:
        return RankAddress(self.replica_group, self.rank)

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def fail(self, state: str, detail: str) -> None:
        self.state, self.detail = state, detail
        self.parts.clear()


@dataclass
class Request:
    """One operator request fanned out to the ranks of a job."""

    request_id: str
    kind: str
    job_id: str
    created_ns: int
    deliveries: dict[RankAddress, RankDelivery]
    excluded: list[Outcome]  # addressed ranks that were never asked, and why
    profile: ProfileSpec | None = None
    max_bytes: int = 0
    step_wait_seconds: float = 0.0
    plan: int = 0
    start_step: int = -1
    planned_here: bool = True  # the daemon chose the start step (so it may choose again)
    replans: int = 0
    closed: bool = False
    # A prepared profile nobody collects (its caller went away) is closed after this time.
    expires_ns: int = 0

    def delivery(self, rank: int, replica_group: int = NO_REPLICA_GROUP) -> RankDelivery:
        """The delivery of one addressed rank (KeyError: the request did not ask it)."""
        return self.deliveries[RankAddress(replica_group, rank)]

    @property
    def received_bytes(self) -> int:
        return sum(d.received_bytes for d in self.deliveries.values())

    def all_done(self) -> bool:
        return all(d.done for d in self.deliveries.values())

    def all_ready(self) -> bool:
        return all(d.done or d.state == "ready" for d in self.deliveries.values())


def ago(now_ns: int, then_ns: int) -> str:
    return f"{max(now_ns - then_ns, 0) / 1e9:.1f}s ago"


def first_common_step(
    endpoints: Sequence[EndpointView], *, now_ns: int, lookahead_seconds: float
) -> int:
    """The first step every rank will still reach: each rank's last reported step, moved on by
    its step rate over the time since it polled plus `lookahead_seconds` (for the order to reach
    it), rounded up, plus one (the step it is in has started already); the largest over ranks,
    at most `MAX_STEP` (a rank reporting absurd steps gets a start it never reaches and is named
    when the capture times out)."""
    start = 0
    for endpoint in endpoints:
        elapsed = max(now_ns - endpoint.last_poll_ns, 0) / 1e9 + lookahead_seconds
        reached = endpoint.hello.step + endpoint.steps_per_second * elapsed
        start = max(start, math.ceil(min(reached, MAX_STEP)) + 1)
    return min(start, MAX_STEP)


def steps_for_seconds(seconds: float, endpoints: Sequence[EndpointView]) -> int:
    """Steps that cover `seconds` at the job's pace (its slowest rank's rate); 0 when no rate
    is known yet (the ranks then stop on their own clock)."""
    rates = [e.steps_per_second for e in endpoints if e.steps_per_second > 0]
    if not rates:
        return 0
    return max(1, math.ceil(seconds * min(rates)))


@dataclass(frozen=True, slots=True)
class Chunk:
    """One `Deliver` call, decoded."""

    request_id: str
    job_id: str
    rank: int
    plan: int = 0
    part: str = ""
    index: int = 0
    data: bytes = b""
    last: bool = False
    error: str = ""
    missed: bool = False  # the error is a missed start step (`first_step`: where the rank was)
    first_step: int = -1
    last_step: int = -1
    clock_offset_ns: int = 0
    clock_rtt_ns: int = 0
    total_bytes: int = 0  # the whole delivery's size, said on its first chunk
    replica_group: int = NO_REPLICA_GROUP

    @property
    def address(self) -> RankAddress:
        return RankAddress(self.replica_group, self.rank)


def describe_outcome(outcome: Outcome) -> str:
    return f"{rank_label(outcome.replica_group, outcome.rank)} {outcome.state}" + (
        f" ({outcome.detail})" if outcome.detail else ""
    )


def describe_outcomes(outcomes: Sequence[Outcome]) -> str:
    """ "rank 1 not polling (last polled 12.0s ago); rank 3 timed out (…)" for the ranks that
    did not deliver."""
    return "; ".join(describe_outcome(o) for o in outcomes if o.state != DELIVERED)
