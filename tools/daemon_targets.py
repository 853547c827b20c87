"""Which daemons an operator command asks: those given, or every daemon of the job.

* `--host A --host B` (or `--hosts-file F`, one address per line, for a job plait did not
  launch): those daemons, asked directly and concurrently, as before.
* otherwise, with a job (`--job J`): **every daemon of the job**, through the local daemon
  (`$PLAIT_DAEMON`, or the default address). It knows the job's nodes from the job's own ranks
  (`plait.daemon.job_directory`) and asks them all at once within `--deadline`
  (`plait.v1.Daemon/AskJob`); no address is typed. Each answer says how many daemons answered
  and names the missing ones with the reason.
* otherwise: the local daemon alone.

`Targets.ask` returns what `daemon_client.call_all` returns — per daemon, its responses to the
questions in order, or a `grpc.RpcError` — so every command merges answers one way, whichever
way they were gathered.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import grpc
import typer
from google.protobuf.message import DecodeError, Message

from plait.daemon.address import resolve_daemon_address
from plait.proto.plait.v1 import control_pb2_grpc, daemon_pb2, daemon_pb2_grpc
from plait.tools.daemon_client import RPC_TIMEOUT_SECONDS, call_each, open_stub

__all__ = [
    "DEFAULT_DEADLINE_SECONDS",
    "Coverage",
    "Deadline",
    "HostsFile",
    "PeerError",
    "Question",
    "Targets",
    "read_hosts_file",
]

DEFAULT_DEADLINE_SECONDS = 5.0
# Beyond the deadline, what the local daemon's own reply may take to come back.
REPLY_MARGIN_SECONDS = 2.0

HostsFile = Annotated[
    Path | None,
    typer.Option(
        "--hosts-file",
        help="daemon addresses, one HOST:PORT per line, for a job plait did not launch; "
        "'slurm' (or 'slurm:PORT') reads this Slurm job's node list",
    ),
]
SLURM = "slurm"
Deadline = Annotated[
    float,
    typer.Option(
        "--deadline",
        help="seconds the job's daemons get to answer; later ones are named missing",
        min=0.1,
    ),
]

Question = tuple[str, Message]  # ("Daemon/GetMetrics", GetMetricsRequest(...))

# The response type of each question a command may ask.
RESPONSES: dict[str, type[Message]] = {}


def _response_type(method: str) -> type[Message]:
    if not RESPONSES:
        from plait.daemon.job_questions import QUESTION_TYPES

        RESPONSES.update({m: types[1] for m, types in QUESTION_TYPES.items()})
    return RESPONSES[method]


class PeerError(grpc.RpcError):
    """A daemon of the job that gave no usable answer, and why (what the local daemon saw)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self.reason


@dataclass(frozen=True, slots=True)
class Missing:
    node: int
    address: str
    reason: str

    def label(self) -> str:
        return f"node{self.node} ({self.address})" if self.node >= 0 else self.address


@dataclass(frozen=True, slots=True)
class Coverage:
    """How much of a job answered: the daemons asked, those that answered, the missing."""

    job_id: str
    asked: int
    answered: int
    missing: tuple[Missing, ...] = ()
    via: str = ""
    seconds: float = 0.0
    nodes: dict[str, int] = field(default_factory=dict)  # address -> node

    def line(self) -> str:
        """ "255/256 daemons of job J answered (via A, 0.21 s); missing: node7 (B:50051)"
        (each missing daemon's reason is on its own line above, as any host's error is)."""
        text = f"{self.answered}/{self.asked} daemons of job {self.job_id} answered"
        if self.via:
            text += f" (via {self.via}, {self.seconds:.2f} s)"
        if self.missing:
            text += "; missing: " + ", ".join(m.label() for m in self.missing)
        return text

    def document(self) -> dict[str, Any]:
        return {
            "job_id": self.job_id,
            "asked": self.asked,
            "answered": self.answered,
            "via": self.via,
            "seconds": self.seconds,
            "missing": [
                {"node": m.node, "address": m.address, "error": m.reason} for m in self.missing
            ],
        }


def read_hosts_file(path: Path) -> list[str]:
    """Addresses from a hosts file: one per line; blank lines and `#` comments skipped. The
    name `slurm` (`slurm:PORT`) stands for the node list of the Slurm job this runs in
    (`$SLURM_JOB_NODELIST`), each node's daemon on the default port (or PORT)."""
    if str(path).split(":")[0] == SLURM:
        return slurm_hosts(str(path))
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise typer.BadParameter(f"cannot read --hosts-file {path}: {exc}") from None
    hosts = [line.split("#", 1)[0].strip() for line in lines]
    hosts = [h for h in hosts if h]
    if not hosts:
        raise typer.BadParameter(f"--hosts-file {path} names no daemon")
    return hosts


def slurm_hosts(spec: str) -> list[str]:
    """`slurm[:PORT]`: the daemons of the nodes of the Slurm job this command runs in."""
    import os

    from plait.core.errors import ConfigError
    from plait.daemon.address import DEFAULT_DAEMON_ADDRESS
    from plait.tools.slurm import expand_hostlist

    _, _, port = spec.partition(":")
    port = port or DEFAULT_DAEMON_ADDRESS.rpartition(":")[2]
    if not port.isdigit():
        raise typer.BadParameter(f"--hosts-file {spec}: the port must be a number")
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise typer.BadParameter(
            f"--hosts-file {spec}: no $SLURM_JOB_NODELIST (run it inside the Slurm job, e.g. "
            "with srun --jobid, or list the daemons in a file)"
        )
    try:
        return [f"{host}:{port}" for host in expand_hostlist(nodelist)]
    except ConfigError as exc:
        raise typer.BadParameter(f"--hosts-file {spec}: {exc}") from None


@dataclass(frozen=True, slots=True)
class Targets:
    """The daemons a command asks (see the module docstring)."""

    hosts: tuple[str, ...]  # asked directly
    job: str = ""
    via: str = ""  # the local daemon that asks the job's daemons ("": asked directly)
    deadline: float = DEFAULT_DEADLINE_SECONDS

    @classmethod
    def resolve(
        cls,
        hosts: Sequence[str] | None,
        job: str = "",
        hosts_file: Path | None = None,
        deadline: float = DEFAULT_DEADLINE_SECONDS,
    ) -> Targets:
        given = [*(hosts or ()), *(read_hosts_file(hosts_file) if hosts_file else ())]
        if given:
            return cls(tuple(dict.fromkeys(given)), job=job, deadline=deadline)
        local = resolve_daemon_address()
        if job:
            return cls((local,), job=job, via=local, deadline=deadline)
        return cls((local,), deadline=deadline)

    @property
    def job_wide(self) -> bool:
        return bool(self.via)

    def ask(
        self, questions: Sequence[Question], *, timeout: float = RPC_TIMEOUT_SECONDS
    ) -> tuple[dict[str, tuple[Any, ...] | grpc.RpcError], Coverage | None]:
        """Every daemon's responses to `questions` (or its error), and for a job-wide ask how
        much of the job answered. `timeout` bounds each direct call."""
        if self.job_wide:
            return self._ask_job(questions)
        return self._ask_directly(questions, timeout), None

    def _ask_directly(
        self, questions: Sequence[Question], timeout: float
    ) -> dict[str, tuple[Any, ...] | grpc.RpcError]:
        def query(channel: grpc.Channel) -> tuple[Any, ...]:
            stubs = {
                "Daemon": daemon_pb2_grpc.DaemonStub(channel),
                "Control": control_pb2_grpc.ControlStub(channel),
            }
            out = []
            for method, request in questions:
                service, name = method.split("/")
                out.append(getattr(stubs[service], name)(request, timeout=timeout))
            return tuple(out)

        return call_each({host: query for host in self.hosts}, stub=lambda channel: channel)

    def _ask_job(
        self, questions: Sequence[Question]
    ) -> tuple[dict[str, tuple[Any, ...] | grpc.RpcError], Coverage | None]:
        request = daemon_pb2.AskJobRequest(
            job_id=self.job,
            questions=[
                daemon_pb2.JobQuestion(method=m, request=r.SerializeToString())
                for m, r in questions
            ],
            deadline_seconds=self.deadline,
        )
        channel, stub = open_stub(self.via)
        try:
            reply = stub.AskJob(request, timeout=self.deadline + REPLY_MARGIN_SECONDS)
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                # A daemon of an older plait: it answers for its own node, as before.
                return self._ask_directly(questions, RPC_TIMEOUT_SECONDS), None
            return {self.via: exc}, None
        finally:
            channel.close()
        results: dict[str, tuple[Any, ...] | grpc.RpcError] = {}
        missing: list[Missing] = []
        nodes: dict[str, int] = {}
        seconds = 0.0
        for answer in reply.answers:
            label = answer.address or self.via
            nodes[label] = answer.node
            seconds = max(seconds, answer.seconds)
            if answer.error:
                missing.append(Missing(answer.node, label, answer.error))
                results[label] = PeerError(answer.error)
                continue
            try:
                results[label] = tuple(
                    _response_type(method).FromString(data)
                    for (method, _), data in zip(questions, answer.responses, strict=True)
                )
            except (DecodeError, ValueError) as exc:
                reason = f"garbled reply: {exc}"
                missing.append(Missing(answer.node, label, reason))
                results[label] = PeerError(reason)
        coverage = Coverage(
            job_id=self.job,
            asked=len(reply.answers),
            answered=len(reply.answers) - len(missing),
            missing=tuple(missing),
            via=self.via,
            seconds=seconds,
            nodes=nodes,
        )
        return results, coverage

    def addresses(self) -> list[str]:
        """The daemons to ask directly: those given, or the job's from the local daemon's
        directory (the local daemon alone when it has none). For the commands whose calls are
        not job questions (a profile's two phases, a trace capture)."""
        if not self.job_wide:
            return list(self.hosts)
        channel, stub = open_stub(self.via)
        try:
            listing = stub.ListJobDaemons(
                daemon_pb2.ListJobDaemonsRequest(job_id=self.job), timeout=RPC_TIMEOUT_SECONDS
            )
        except grpc.RpcError:
            return [self.via]  # an older daemon: no directory to read
        finally:
            channel.close()
        found = list(dict.fromkeys(d.address for d in listing.daemons))
        return found or [self.via]
