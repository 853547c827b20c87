"""One job's questions asked of all its daemons at once: `plait.v1.Daemon/AskJob`.

An operator (or the web page) asks any daemon of a job; that daemon asks every other daemon of
the job the same questions (`GetMetrics`, `Status`, `Stacks`, ...) and returns each one's
answers, or why it gave none. What travels is what the questions' own RPCs return for one
node, already filtered to the job: per-rank figures, never spans.

**Bounded.** At most `max_in_flight` daemons are asked at once, over channels kept open between
queries (a query every second must not set up hundreds of connections), and nothing is waited
for past the deadline: a daemon that has not answered by then is missing, named, never merged.

**A peer is trusted only for what it proves.** A peer's answer counts when it is an `AskJob`
reply of this protocol, for this job, with one response per question, from the host the
directory names. Otherwise the daemon is missing, with the reason: unreachable, no answer
within the deadline (stopped, overloaded), an older plait (no `AskJob`), holds no such job,
answers as another host or job, or a reply that does not parse.

Daemon-to-daemon calls carry the daemon's own client credentials
(`plait.daemon.security.SecurityConfig.peer_auth`): the fleet's token and TLS roots.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError, Message

from plait.daemon.client_auth import DaemonClientAuth
from plait.daemon.job_directory import JobDirectory, seen_from
from plait.daemon.local_calls import LocalCallError, LocalContext
from plait.proto.plait.v1 import control_pb2, daemon_pb2, daemon_pb2_grpc

__all__ = [
    "PROTOCOL",
    "QUESTION_TYPES",
    "JobQuestions",
    "PeerChannels",
    "check_peer_answer",
]

# The version of `AskJob` this daemon speaks; a peer answering with less is an older plait.
PROTOCOL = 1
DEFAULT_DEADLINE_SECONDS = 5.0
DEFAULT_MAX_IN_FLIGHT = 64
# Past the deadline the fan-out returns without the late answers; this much is for the
# last callbacks to land (they run on gRPC's threads).
SETTLE_SECONDS = 0.05

# The questions one daemon answers for a job: method -> (request type, response type).
QUESTION_TYPES: dict[str, tuple[type[Message], type[Message]]] = {
    "Daemon/Status": (daemon_pb2.StatusRequest, daemon_pb2.StatusResponse),
    "Daemon/ListRanks": (daemon_pb2.ListRanksRequest, daemon_pb2.ListRanksResponse),
    "Daemon/GetMetrics": (daemon_pb2.GetMetricsRequest, daemon_pb2.GetMetricsResponse),
    "Daemon/GetBottleneck": (daemon_pb2.GetBottleneckRequest, daemon_pb2.GetBottleneckResponse),
    "Control/ListEndpoints": (
        control_pb2.ListEndpointsRequest,
        control_pb2.ListEndpointsResponse,
    ),
    "Control/Clock": (control_pb2.ClockRequest, control_pb2.ClockResponse),
    "Control/Stacks": (control_pb2.StacksRequest, control_pb2.StacksResponse),
    "Control/Memory": (control_pb2.MemoryRequest, control_pb2.MemoryResponse),
}


class PeerChannels:
    """One open channel per peer daemon, reused across queries (gRPC reconnects by itself)."""

    def __init__(self, auth: DaemonClientAuth) -> None:
        self.auth = auth
        self._lock = threading.Lock()
        self._stubs: dict[str, tuple[grpc.Channel, daemon_pb2_grpc.DaemonStub]] = {}

    def stub(self, address: str) -> daemon_pb2_grpc.DaemonStub:
        with self._lock:
            if address not in self._stubs:
                channel = self.auth.channel(address)
                self._stubs[address] = (channel, daemon_pb2_grpc.DaemonStub(channel))
            return self._stubs[address][1]

    def close(self) -> None:
        with self._lock:
            stubs, self._stubs = self._stubs, {}
        for channel, _ in stubs.values():
            channel.close()


@dataclass(frozen=True, slots=True)
class Peer:
    """A daemon to ask: its node in the job (-1: none reported), host, address."""

    node: int
    host: str
    address: str
    here: bool  # this daemon itself: answered in-process


def check_peer_answer(
    response: daemon_pb2.AskJobResponse, peer: Peer, job_id: str, questions: int
) -> str:
    """Why a peer's reply cannot be merged ("" when it can)."""
    if response.protocol < PROTOCOL:
        return f"speaks job protocol {response.protocol}, this daemon {PROTOCOL} (older plait)"
    if len(response.answers) != 1:
        return f"sent {len(response.answers)} answers for one daemon"
    answer = response.answers[0]
    if answer.error:
        return answer.error
    if answer.job_id != job_id:
        return f"answered for job {answer.job_id!r}, not {job_id!r}"
    if peer.host and answer.host and answer.host != peer.host:
        return f"answered as host {answer.host!r}, the job's ranks there said {peer.host!r}"
    if len(answer.responses) != questions:
        return f"sent {len(answer.responses)} responses to {questions} questions"
    return ""


def _without_responses(answer: daemon_pb2.DaemonAnswer, reason: str) -> daemon_pb2.DaemonAnswer:
    """`answer` refused for `reason`: no partial answers go with an error."""
    del answer.responses[:]
    answer.error = reason
    return answer


def _rpc_reason(exc: grpc.RpcError, deadline: float) -> str:
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer within the {deadline:g} s deadline (stopped or overloaded?)"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return "answers no job questions (an older plait daemon)"
    if code == grpc.StatusCode.UNAVAILABLE:
        return f"unreachable: {details}"
    return f"{code.name if code else 'ERROR'}: {details}"


@dataclass
class _Gather:
    """The answers of one fan-out as they come back (filled from gRPC's callback threads)."""

    expected: int
    answers: dict[str, daemon_pb2.DaemonAnswer] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    complete: threading.Event = field(default_factory=threading.Event)

    def put(self, address: str, answer: daemon_pb2.DaemonAnswer) -> None:
        with self.lock:
            self.answers.setdefault(address, answer)
            if len(self.answers) >= self.expected:
                self.complete.set()


class JobQuestions:
    """Answers `AskJob` and `ListJobDaemons` for one daemon."""

    def __init__(
        self,
        *,
        directory: JobDirectory,
        hostname: str,
        handlers: Mapping[str, Callable[[Any, Any], Message]],
        holds_job: Callable[[str], bool],
        channels: PeerChannels,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.directory = directory
        self.hostname = hostname
        self.handlers = handlers  # method -> the servicer's bound method
        self.holds_job = holds_job
        self.channels = channels
        self.clock = clock
        self.refused = 0  # questions refused (unknown method, malformed request)

    # -- where the job's daemons are -----------------------------------------------------------

    def peers(self, job_id: str) -> list[Peer]:
        """The job's daemons from its directory (every replica group's latest world), each
        address as reached from this host, in node order, one entry per address."""
        seen: dict[str, Peer] = {}
        for report in self.directory.reports(job_id):
            for node in report.nodes:
                address = seen_from(node, self.hostname)
                here = node.node == report.here
                known = seen.get(address)
                if known is None or (here and not known.here):
                    seen[address] = Peer(node.node, node.host, address, here)
        return sorted(seen.values(), key=lambda p: (p.node, p.address))

    def list_daemons(self, job_id: str) -> daemon_pb2.ListJobDaemonsResponse:
        reports = self.directory.reports(job_id)
        daemons = [
            daemon_pb2.JobDaemon(
                node=node.node,
                host=node.host,
                address=seen_from(node, self.hostname),
                ranks=node.ranks,
                replica_group=report.replica_group if report.replica_group >= 0 else None,
            )
            for report in reports
            for node in report.nodes
        ]
        return daemon_pb2.ListJobDaemonsResponse(
            job_id=job_id,
            daemons=daemons,
            reported_unix_nano=max((r.reported_unix_nano for r in reports), default=0),
            hostname=self.hostname,
        )

    # -- this daemon's own answer --------------------------------------------------------------

    def answer_here(
        self, request: daemon_pb2.AskJobRequest, node: int = -1
    ) -> daemon_pb2.DaemonAnswer:
        started = self.clock()
        answer = daemon_pb2.DaemonAnswer(
            node=node, host=self.hostname, job_id=request.job_id, protocol=PROTOCOL
        )
        if not self.holds_job(request.job_id):
            answer.error = f"holds no job {request.job_id!r}"
            return answer
        context: Any = LocalContext()
        for question in request.questions:
            types = QUESTION_TYPES.get(question.method)
            if types is None or question.method not in self.handlers:
                self.refused += 1
                return _without_responses(answer, f"cannot answer {question.method!r} for a job")
            try:
                message = types[0].FromString(question.request)
                response = self.handlers[question.method](message, context)
            except DecodeError:
                self.refused += 1
                return _without_responses(answer, f"{question.method}: the request does not parse")
            except LocalCallError as exc:
                return _without_responses(answer, f"{question.method}: {exc}")
            answer.responses.append(response.SerializeToString())
        answer.seconds = self.clock() - started
        return answer

    # -- every daemon of the job ---------------------------------------------------------------

    def ask_others(
        self, job_id: str, questions: Sequence[tuple[str, Message]], deadline: float
    ) -> list[daemon_pb2.DaemonAnswer]:
        """The job's other daemons' answers (this daemon's own part is the caller's): for the
        web page, which holds its own answers already. Empty for a job on this node alone."""
        others = [p for p in self.peers(job_id) if not p.here]
        if not others:
            return []
        request = daemon_pb2.AskJobRequest(
            job_id=job_id,
            questions=[
                daemon_pb2.JobQuestion(method=m, request=r.SerializeToString())
                for m, r in questions
            ],
        )
        return self._fan_out(request, others, deadline)

    def ask(self, request: daemon_pb2.AskJobRequest) -> daemon_pb2.AskJobResponse:
        deadline = request.deadline_seconds or DEFAULT_DEADLINE_SECONDS
        reply = daemon_pb2.AskJobResponse(
            job_id=request.job_id, protocol=PROTOCOL, deadline_seconds=deadline
        )
        if request.local_only:
            reply.answers.append(self.answer_here(request))
            return reply
        reply.source = "directory"
        peers = self.peers(request.job_id)
        if not peers:  # a job no rank reported nodes for: this daemon's own part
            reply.source = "here"
            peers = [Peer(-1, self.hostname, "", True)]
        reply.answers.extend(self._fan_out(request, peers, deadline))
        return reply

    def _fan_out(
        self, request: daemon_pb2.AskJobRequest, peers: Sequence[Peer], deadline: float
    ) -> list[daemon_pb2.DaemonAnswer]:
        started = self.clock()
        ends = started + deadline
        limit = max(1, request.max_in_flight or DEFAULT_MAX_IN_FLIGHT)
        slots = threading.BoundedSemaphore(limit)
        remote = [p for p in peers if not p.here]
        gather = _Gather(expected=len(remote))
        if not remote:
            gather.complete.set()
        forwarded = daemon_pb2.AskJobRequest(
            job_id=request.job_id,
            questions=request.questions,
            local_only=True,
            protocol=PROTOCOL,
        )
        questions = len(request.questions)

        def missing(peer: Peer, reason: str) -> daemon_pb2.DaemonAnswer:
            return daemon_pb2.DaemonAnswer(
                node=peer.node,
                host=peer.host,
                address=peer.address,
                error=reason,
                job_id=request.job_id,
                seconds=self.clock() - started,
            )

        def landed(peer: Peer, future: grpc.Future) -> None:
            slots.release()
            try:
                response = future.result()
            except grpc.RpcError as exc:
                gather.put(peer.address, missing(peer, _rpc_reason(exc, deadline)))
                return
            except Exception as exc:  # a reply that does not parse
                gather.put(peer.address, missing(peer, f"garbled reply: {exc}"))
                return
            reason = check_peer_answer(response, peer, request.job_id, questions)
            if reason:
                gather.put(peer.address, missing(peer, reason))
                return
            answer = response.answers[0]
            answer.node, answer.address = peer.node, peer.address
            answer.host = answer.host or peer.host
            answer.seconds = self.clock() - started
            gather.put(peer.address, answer)

        sender = threading.Thread(
            target=self._send,
            args=(remote, forwarded, ends, slots, gather, landed, missing),
            name="plait-ask-job",
            daemon=True,
        )
        sender.start()
        # This daemon's own part meanwhile, on this thread.
        local = [self._here(request, p, started) for p in peers if p.here]
        gather.complete.wait(max(0.0, ends - self.clock()) + SETTLE_SECONDS)
        with gather.lock:
            answers = dict(gather.answers)
        out = []
        for peer in peers:
            if peer.here:
                out.append(local.pop(0))
            else:
                out.append(
                    answers.get(peer.address)
                    or missing(peer, f"no answer within the {deadline:g} s deadline")
                )
        return out

    def _here(
        self, request: daemon_pb2.AskJobRequest, peer: Peer, started: float
    ) -> daemon_pb2.DaemonAnswer:
        answer = self.answer_here(request, peer.node)
        answer.address = peer.address
        answer.seconds = self.clock() - started
        return answer

    def _send(
        self,
        peers: Sequence[Peer],
        forwarded: daemon_pb2.AskJobRequest,
        ends: float,
        slots: threading.BoundedSemaphore,
        gather: _Gather,
        landed: Callable[[Peer, grpc.Future], None],
        missing: Callable[[Peer, str], daemon_pb2.DaemonAnswer],
    ) -> None:
        """Ask each peer as a slot frees, until the deadline; the rest are never asked."""
        for index, peer in enumerate(peers):
            remaining = ends - self.clock()
            if remaining <= 0 or not slots.acquire(timeout=remaining):
                for late in peers[index:]:
                    gather.put(late.address, missing(late, "not asked before the deadline"))
                return
            try:
                future = self.channels.stub(peer.address).AskJob.future(
                    forwarded, timeout=max(ends - self.clock(), 0.001)
                )
            except Exception as exc:  # a bad address is that peer's fault alone
                slots.release()
                gather.put(peer.address, missing(peer, f"cannot be asked: {exc}"))
                continue
            future.add_done_callback(lambda f, p=peer: landed(p, f))
