"""The control channel's daemon side: who polls, what waits for them, what operators asked.

Ranks poll from their telemetry exporter thread (`ControlRegistry.poll`), which registers them
on the first call and hands them the orders waiting for them; they answer in chunks
(`ControlRegistry.deliver`). An operator's request (`ControlRegistry.open`) addresses ranks of
one job (every replica group of it, or one); the gRPC thread serving it waits
(`ControlRegistry.wait`) until every rank delivered, failed, stopped polling or ran out of time,
and every rank gets an `Outcome` that says which. Ranks are keyed by (job, replica group, rank).

A profile is taken in two rounds. Every rank first makes its profiler ready (the first
`torch.profiler` start in a process costs seconds, spent off the training thread); then the
daemon (or a CLI addressing several daemons) picks the first step every rank will still reach
from their step rates (`first_common_step`, in the spirit of Dynolog's iteration round-up),
and every rank records from there. A rank already past that step reports a miss and the daemon
picks again, further ahead.

No gRPC types here: the records are in `plait.daemon.control_records`, and
`plait.daemon.control_service` translates. One lock guards everything; waiters sleep on a
condition of that lock.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Collection, Sequence

from plait.daemon.control_records import (
    CANCEL,
    CAPTURE_KINDS,
    DELIVERED,
    FAILED,
    LEFT,
    MAX_REPLANS,
    MISSED,
    NOT_POLLING,
    NOT_READY,
    OVER_LIMIT,
    PROFILE,
    REJECTED,
    TIMED_OUT,
    UNKNOWN_RANK,
    Chunk,
    ControlLimits,
    Endpoint,
    EndpointView,
    Order,
    Outcome,
    ProfileSpec,
    RankAddress,
    RankDelivery,
    RankHello,
    Refusal,
    Request,
    ago,
    describe_outcome,
    first_common_step,
    rank_label,
)
from plait.daemon.telemetry_schema import NO_REPLICA_GROUP

# A rank silent this long is forgotten (asked for, it is then an unknown job or rank).
FORGET_AFTER_SECONDS = 3600.0


class ControlRegistry:
    """Endpoints, their pending orders, and open requests, behind one lock."""

    def __init__(self, limits: ControlLimits | None = None) -> None:
        self.limits = limits or ControlLimits()
        self.lock = threading.Lock()
        self._changed = threading.Condition(self.lock)
        # (job, replica group, rank) -> endpoint: two groups' rank 0 are two endpoints.
        self._endpoints: dict[tuple[str, int, int], Endpoint] = {}
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count(1)
        self.refused = 0
        self.rejected_chunks = 0

    # -- the ranks ------------------------------------------------------------------------------

    def poll(self, hello: RankHello, now_ns: int) -> list[Order]:
        """Record a rank's poll; return the orders it has not acknowledged yet."""
        with self.lock:
            endpoint = self._endpoints.get(hello.key)
            if endpoint is None or endpoint.hello.pid != hello.pid:
                self._forget(now_ns)
                endpoint = Endpoint(hello, first_poll_ns=now_ns, last_poll_ns=now_ns)
                self._endpoints[hello.key] = endpoint
            endpoint.record(hello, now_ns)
            endpoint.left_ns = now_ns if hello.leaving else 0
            changed = self._note_rank_state(hello, now_ns)
            acked = set(hello.busy) | {f"{r}:0" for r in hello.ready}
            endpoint.pending = [
                o
                for o in endpoint.pending
                if o.ack not in acked and not self._answered(o, hello.address)
            ]
            orders = list(endpoint.pending)
            # Cancels are sent once: a rank that missed one finds its request gone anyway.
            endpoint.pending = [o for o in endpoint.pending if o.kind != CANCEL]
            if changed:
                self._changed.notify_all()
            return orders

    def _forget(self, now_ns: int) -> None:
        """Drop ranks silent for `FORGET_AFTER_SECONDS` (a long-lived daemon sees many jobs
        come and go); a rank an open request still waits for is kept."""
        waited = {(r.job_id, *address) for r in self._requests.values() for address in r.deliveries}
        for key, endpoint in list(self._endpoints.items()):
            if key not in waited and (now_ns - endpoint.last_poll_ns) / 1e9 > FORGET_AFTER_SECONDS:
                del self._endpoints[key]

    def _answered(self, order: Order, address: RankAddress) -> bool:
        """The order's request is over, or this rank has answered it (cancels always go)."""
        if order.kind == CANCEL:
            return False
        request = self._requests.get(order.request_id)
        if request is None or request.closed:
            return True
        delivery = request.deliveries.get(address)
        return delivery is None or delivery.done

    def _note_rank_state(self, hello: RankHello, now_ns: int) -> bool:
        """Readiness and departure of a rank for every open request; True if any changed."""
        changed = False
        for request in self._requests.values():
            delivery = request.deliveries.get(hello.address)
            if request.job_id != hello.job_id or delivery is None or delivery.done:
                continue
            if hello.leaving:
                delivery.fail(LEFT, f"its run ended before it answered ({hello.host})")
                changed = True
            elif delivery.state == "asked" and request.request_id in hello.ready:
                delivery.state = "ready"
                changed = True
        return changed

    def deliver(self, chunk: Chunk, now_ns: int) -> tuple[bool, str]:
        """Take one chunk of a rank's answer; (accepted, why not)."""
        with self.lock:
            request = self._requests.get(chunk.request_id)
            if request is None or request.closed:
                self.rejected_chunks += 1
                return False, f"no open request {chunk.request_id!r} (finished or timed out)"
            delivery = request.deliveries.get(chunk.address)
            label = rank_label(chunk.replica_group, chunk.rank)
            if request.job_id != chunk.job_id or delivery is None:
                self.rejected_chunks += 1
                return False, f"{label} of job {chunk.job_id!r} was not asked"
            if delivery.done:
                self.rejected_chunks += 1
                return False, f"{label} already answered ({delivery.state})"
            if request.kind == PROFILE and chunk.plan != request.plan:
                self.rejected_chunks += 1
                return False, f"plan {chunk.plan} was replaced by plan {request.plan}"
            accepted, reason = self._take(request, delivery, chunk, now_ns)
            self._changed.notify_all()
            return accepted, reason

    def _take(
        self, request: Request, delivery: RankDelivery, chunk: Chunk, now_ns: int
    ) -> tuple[bool, str]:
        if chunk.error:
            if chunk.missed and request.planned_here and request.replans < MAX_REPLANS:
                self._replan(request, now_ns, missed_at=chunk.first_step)
                return True, ""
            delivery.fail(MISSED if chunk.missed else FAILED, chunk.error)
            return True, ""
        limits = self.limits
        if chunk.index != delivery.next_index:
            delivery.fail(REJECTED, f"chunk {chunk.index} arrived, {delivery.next_index} expected")
            self.rejected_chunks += 1
            return False, delivery.detail
        size = delivery.received_bytes + len(chunk.data)
        cap = request.max_bytes or limits.max_rank_bytes
        if size > cap or request.received_bytes + len(chunk.data) > limits.max_request_bytes:
            delivery.fail(
                OVER_LIMIT,
                f"its answer passed {cap // 2**20} MiB (per rank) or "
                f"{limits.max_request_bytes // 2**20} MiB (per request); record fewer steps",
            )
            self.rejected_chunks += 1
            return False, delivery.detail
        if chunk.index == 0:
            delivery.first_step, delivery.last_step = chunk.first_step, chunk.last_step
            delivery.clock_offset_ns = chunk.clock_offset_ns
            delivery.clock_rtt_ns = chunk.clock_rtt_ns
            delivery.expected_bytes = chunk.total_bytes
        delivery.parts.setdefault(chunk.part, bytearray()).extend(chunk.data)
        delivery.received_bytes = size
        delivery.next_index += 1
        if chunk.last and size != delivery.expected_bytes:
            delivery.fail(
                REJECTED, f"the delivery ended at {size} of {delivery.expected_bytes} bytes"
            )
            self.rejected_chunks += 1
            return False, delivery.detail
        delivery.state = DELIVERED if chunk.last else "delivering"
        return True, ""

    # -- operators ------------------------------------------------------------------------------

    def endpoints(
        self, job_id: str = "", now_ns: int = 0, replica_group: int | None = None
    ) -> list[EndpointView]:
        with self.lock:
            return [self._view(e, now_ns) for e in self._job_endpoints(job_id, replica_group)]

    def _job_endpoints(self, job_id: str, replica_group: int | None = None) -> list[Endpoint]:
        """The job's endpoints (every job's when `job_id` is empty), of one replica group when
        `replica_group` is given; ordered by job, group, rank."""
        return [
            e
            for key, e in sorted(self._endpoints.items())
            if (not job_id or key[0] == job_id)
            and (replica_group is None or key[1] == replica_group)
        ]

    def _endpoint_of(self, request: Request, address: RankAddress) -> Endpoint | None:
        return self._endpoints.get((request.job_id, *address))

    def _view(self, endpoint: Endpoint, now_ns: int) -> EndpointView:
        return EndpointView(
            hello=endpoint.hello,
            last_poll_ns=endpoint.last_poll_ns,
            steps_per_second=endpoint.steps_per_second(),
            polling=endpoint.polling(now_ns, self.limits.poll_patience_seconds),
            left=bool(endpoint.left_ns),
        )

    def open(
        self,
        kind: str,
        job_id: str,
        ranks: Sequence[int],
        *,
        now_ns: int,
        known_jobs: Collection[str] = (),
        profile: ProfileSpec | None = None,
        step_wait_seconds: float = 0.0,
        replica_group: int | None = None,
    ) -> Request:
        """Start a request and queue its orders; `Refusal` when no addressed rank can take it.

        `ranks` are ranks within each replica group the request reaches: every group of the job
        on this daemon, or only `replica_group` when given. `known_jobs` are jobs the daemon
        knows from their telemetry (a job whose ranks export spans but never poll is named as
        such, not as unknown)."""
        if not job_id:
            raise Refusal("invalid_argument", "a job id is required (--job)")
        if replica_group is not None and replica_group < 0:
            raise Refusal("invalid_argument", f"replica_group: must be >= 0, got {replica_group}")
        with self.lock:
            job_endpoints = self._job_endpoints(job_id)
            if not job_endpoints:
                raise self._unknown_job(job_id, known_jobs)
            endpoints = {
                e.hello.address: e
                for e in job_endpoints
                if replica_group is None or e.hello.replica_group == replica_group
            }
            if not endpoints:
                raise self._unknown_group(job_id, replica_group, job_endpoints)
            groups = sorted({a.replica_group for a in endpoints} - {NO_REPLICA_GROUP})
            if kind == PROFILE and replica_group is None and groups:
                # Each replica group is its own world with its own collectives: one merged trace
                # and its cross-rank analysis are of one world (rank 0 of two groups would be
                # one process, and their collectives matched as one).
                self.refused += 1
                raise Refusal(
                    "invalid_argument",
                    f"replica_group: job {job_id!r} is fault tolerant; a profile takes one "
                    f"replica group at a time (--replica-group; on this daemon: "
                    f"{', '.join(map(str, groups))})",
                )
            deliveries, excluded = self._reachable_ranks(
                job_id, endpoints, ranks, replica_group, now_ns
            )
            if not deliveries:
                self.refused += 1
                raise Refusal(
                    "failed_precondition",
                    f"no addressed rank of job {job_id!r} is polling: "
                    + "; ".join(describe_outcome(o) for o in excluded),
                )
            if kind in CAPTURE_KINDS:
                self._check_capacity(job_id, now_ns)
            request = Request(
                request_id=f"{kind}-{next(self._ids)}",
                kind=kind,
                job_id=job_id,
                created_ns=now_ns,
                deliveries=deliveries,
                excluded=excluded,
                profile=profile,
                max_bytes=self.limits.max_rank_bytes,
                step_wait_seconds=step_wait_seconds,
            )
            self._requests[request.request_id] = request
            order = Order(
                request.request_id,
                kind,
                profile=profile,
                max_bytes=request.max_bytes,
                step_wait_seconds=step_wait_seconds,
            )
            for address in deliveries:
                endpoints[address].pending.append(order)
            return request

    def _reachable_ranks(
        self,
        job_id: str,
        endpoints: dict[RankAddress, Endpoint],
        ranks: Sequence[int],
        replica_group: int | None,
        now_ns: int,
    ) -> tuple[dict[RankAddress, RankDelivery], list[Outcome]]:
        """The addressed ranks that poll (to deliver to) and the outcomes of those that cannot
        take the request: never heard from, left, or no longer polling."""
        wanted = sorted(a for a in endpoints if not ranks or a.rank in ranks)
        deliveries: dict[RankAddress, RankDelivery] = {}
        excluded: list[Outcome] = []
        never_heard = sorted(set(ranks) - {a.rank for a in wanted})
        unknown_group = NO_REPLICA_GROUP if replica_group is None else replica_group
        for rank in never_heard:
            excluded.append(
                Outcome(
                    job_id, rank, "", UNKNOWN_RANK, "this daemon never heard from it",
                    replica_group=unknown_group,
                )
            )  # fmt: skip
        for address in wanted:
            endpoint = endpoints[address]
            if endpoint.left_ns:
                excluded.append(self._outcome(endpoint, LEFT, now_ns))
            elif not endpoint.polling(now_ns, self.limits.poll_patience_seconds):
                excluded.append(self._outcome(endpoint, NOT_POLLING, now_ns))
            else:
                deliveries[address] = RankDelivery(
                    rank=address.rank,
                    host=endpoint.hello.host,
                    replica_group=address.replica_group,
                )
        excluded.sort(key=lambda o: o.address)
        return deliveries, excluded

    def _unknown_group(
        self, job_id: str, replica_group: int | None, job_endpoints: list[Endpoint]
    ) -> Refusal:
        self.refused += 1
        groups = sorted({e.hello.replica_group for e in job_endpoints})
        if groups == [NO_REPLICA_GROUP]:
            return Refusal(
                "not_found",
                f"job {job_id!r} has no replica groups on this daemon (not a fault-tolerant "
                f"job); leave out the replica group to reach its ranks",
            )
        return Refusal(
            "not_found",
            f"no replica group {replica_group} of job {job_id!r} on this daemon (it knows "
            f"groups: {', '.join(str(g) for g in groups if g != NO_REPLICA_GROUP)})",
        )

    def _unknown_job(self, job_id: str, known_jobs: Collection[str]) -> Refusal:
        self.refused += 1
        if job_id in known_jobs:
            return Refusal(
                "failed_precondition",
                f"the ranks of job {job_id!r} send telemetry but never polled this daemon's "
                "control channel (a plait without it, or telemetry that ended)",
            )
        polled = sorted({key[0] for key in self._endpoints} | set(known_jobs))
        return Refusal(
            "not_found",
            f"no job {job_id!r} on this daemon"
            + (f" (it knows: {', '.join(polled)})" if polled else " (it knows no job)"),
        )

    def prepared(self, request: Request, now_ns: int) -> None:
        """The profilers are ready: the request waits for its collect call, not for ever."""
        with self.lock:
            request.expires_ns = now_ns + int(self.limits.prepared_ttl_seconds * 1e9)

    def _expire(self, now_ns: int) -> None:
        for request in list(self._requests.values()):
            if request.expires_ns and request.plan == 0 and now_ns > request.expires_ns:
                self._close(request, now_ns, "nobody collected the prepared profile")

    def _check_capacity(self, job_id: str, now_ns: int) -> None:
        self._expire(now_ns)
        active = [r for r in self._requests.values() if r.kind in CAPTURE_KINDS and not r.closed]
        for other in active:
            if other.job_id == job_id:
                self.refused += 1
                raise Refusal(
                    "resource_exhausted",
                    f"a {other.kind} of job {job_id!r} is already running ({other.request_id}, "
                    f"started {ago(now_ns, other.created_ns)}); one capture per job at a time",
                )
        if len(active) >= self.limits.max_captures:
            self.refused += 1
            raise Refusal(
                "resource_exhausted",
                f"{len(active)} captures are running ("
                + ", ".join(f"{r.request_id} of job {r.job_id}" for r in active)
                + f"); the daemon takes at most {self.limits.max_captures} at once",
            )

    def _outcome(self, endpoint: Endpoint, state: str, now_ns: int) -> Outcome:
        hello = endpoint.hello
        if state == LEFT:
            detail = f"its run ended {ago(now_ns, endpoint.left_ns)}"
        else:
            detail = f"last polled {ago(now_ns, endpoint.last_poll_ns)}"
        return Outcome(
            hello.job_id, hello.rank, hello.host, state, detail, endpoint.last_poll_ns,
            replica_group=hello.replica_group,
        )  # fmt: skip

    def get(self, request_id: str) -> Request | None:
        with self.lock:
            return self._requests.get(request_id)

    def start_profile(self, request: Request, start_step: int | None, now_ns: int) -> int:
        """Give every ready rank its start step (chosen here when `start_step` is None); ranks
        not ready yet are dropped. Returns the start step."""
        with self.lock:
            for delivery in request.deliveries.values():
                if not delivery.done and delivery.state != "ready":
                    delivery.fail(NOT_READY, "its profiler was not ready in time")
                    self._cancel(request, delivery.address, "not ready in time")
            request.planned_here = start_step is None
            request.expires_ns = 0
            self._plan(request, start_step, now_ns)
            self._changed.notify_all()
            return request.start_step

    def _plan(
        self, request: Request, start_step: int | None, now_ns: int, *, at_least: int = 0
    ) -> None:
        addresses = [a for a, d in request.deliveries.items() if not d.done]
        if start_step is None:
            views = [self._view(self._endpoints[(request.job_id, *a)], now_ns) for a in addresses]
            # Each new plan after a miss looks twice as far ahead.
            lookahead = self.limits.plan_lookahead_seconds * 2**request.replans
            start_step = first_common_step(views, now_ns=now_ns, lookahead_seconds=lookahead)
        request.plan += 1
        request.start_step = max(start_step, at_least)
        order = Order(
            request.request_id,
            PROFILE,
            plan=request.plan,
            start_step=request.start_step,
            profile=request.profile,
            max_bytes=request.max_bytes,
        )
        for address in addresses:
            delivery = request.deliveries[address]
            delivery.state, delivery.plan = "asked to start", request.plan
            delivery.parts.clear()
            delivery.received_bytes = delivery.next_index = 0
            endpoint = self._endpoints[(request.job_id, *address)]
            endpoint.pending = [o for o in endpoint.pending if o.request_id != request.request_id]
            endpoint.pending.append(order)

    def _replan(self, request: Request, now_ns: int, *, missed_at: int) -> None:
        """A rank was past the start step when its order came: every rank starts again, further
        ahead (traces already delivered under the old plan are dropped: steps must match)."""
        request.replans += 1
        for delivery in request.deliveries.values():
            if delivery.state == DELIVERED:
                delivery.state = "ready"
        self._plan(request, None, now_ns, at_least=missed_at + 1)

    def wait(
        self,
        request: Request,
        until: Callable[[Request], bool],
        *,
        deadline_ns: int,
        clock: Callable[[], int],
        stopping: threading.Event | None = None,
    ) -> bool:
        """Sleep until `until(request)` holds (True) or the deadline passes (False). Ranks that
        stop polling meanwhile are given up at once, not at the deadline."""
        with self.lock:
            while True:
                now = clock()
                self._give_up_silent(request, now)
                if until(request):
                    return True
                if now >= deadline_ns or (stopping is not None and stopping.is_set()):
                    return False
                self._changed.wait(min((deadline_ns - now) / 1e9, 0.5))

    def _give_up_silent(self, request: Request, now_ns: int) -> None:
        for delivery in request.deliveries.values():
            if delivery.done:
                continue
            endpoint = self._endpoint_of(request, delivery.address)
            if endpoint is None or endpoint.polling(now_ns, self.limits.poll_patience_seconds):
                continue
            outcome = self._outcome(endpoint, NOT_POLLING, now_ns)
            delivery.fail(NOT_POLLING, f"stopped polling while asked: {outcome.detail}")

    def close(self, request: Request, now_ns: int) -> list[Outcome]:
        """End a request: ranks still working are cancelled and named; every addressed rank's
        outcome is returned (delivered parts stay on the request for the caller)."""
        with self.lock:
            return self._close(request, now_ns, "the request timed out")

    def _close(self, request: Request, now_ns: int, reason: str) -> list[Outcome]:
        request.closed = True
        self._requests.pop(request.request_id, None)
        outcomes = list(request.excluded)
        for address, delivery in sorted(request.deliveries.items()):
            if not delivery.done:
                delivery.fail(TIMED_OUT, self._timeout_detail(request, address))
                self._cancel(request, address, reason)
            endpoint = self._endpoint_of(request, address)
            outcomes.append(
                Outcome(
                    request.job_id,
                    address.rank,
                    delivery.host,
                    delivery.state,
                    delivery.detail,
                    endpoint.last_poll_ns if endpoint else 0,
                    replica_group=address.replica_group,
                )
            )
        self._changed.notify_all()
        return sorted(outcomes, key=lambda o: o.address)

    def _timeout_detail(self, request: Request, address: RankAddress) -> str:
        endpoint = self._endpoint_of(request, address)
        step = endpoint.hello.step if endpoint else -1
        if request.kind == PROFILE and request.start_step >= 0:
            return f"no trace in time (asked to start at step {request.start_step}, at step {step})"
        return f"no answer in time (at step {step})"

    def _cancel(self, request: Request, address: RankAddress, reason: str) -> None:
        endpoint = self._endpoint_of(request, address)
        if endpoint is not None:
            endpoint.pending = [o for o in endpoint.pending if o.request_id != request.request_id]
            endpoint.pending.append(Order(request.request_id, CANCEL, reason=reason))
