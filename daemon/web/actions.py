"""The page's buttons: `plait profile`, `plait memory` and a hung rank's stacks, in-process.

Each asks this daemon's control service the way the CLI command asks it over gRPC, and answers
with the document that command's `--json` prints (`profile_document`, the memory and stacks
documents), the files it would write kept in `Captures` for the browser to download. The trace
is the merged, gzip-compressed Perfetto trace the daemon assembled; the page opens it in
Perfetto's UI from the browser's memory, so it is never uploaded anywhere.
"""

from __future__ import annotations

import json
import re
import secrets
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

from plait.daemon import json_documents as daemon_json
from plait.daemon.control_messages import replica_group_of
from plait.daemon.control_records import rank_file_prefix
from plait.daemon.control_service import ControlService
from plait.daemon.job_questions import JobQuestions
from plait.daemon.job_reports import profile_document
from plait.daemon.local_calls import LocalCallError, LocalContext
from plait.daemon.telemetry_schema import NO_REPLICA_GROUP
from plait.proto.plait.v1 import control_pb2, daemon_pb2

KEPT_CAPTURES = 8  # the oldest capture's files go when a ninth arrives
PROFILE_TIMEOUT_SECONDS = 120.0
STACKS_TIMEOUT_SECONDS = 5.0  # as `plait status` waits for a hung job's stacks
JOB_MARGIN_SECONDS = 2.0  # what the other daemons' replies may add to their ranks' wait
MEMORY_WAIT_SECONDS = 10.0  # `plait memory`'s default --wait
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]+")


class Captures:
    """Files the page's actions produced, each capture in a folder of its own, by id."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="plait-web-"))
        self._kept: OrderedDict[str, Path] = OrderedDict()
        self._lock = threading.Lock()

    def new(self) -> tuple[str, Path]:
        capture = secrets.token_hex(8)
        folder = self.root / capture
        folder.mkdir()
        with self._lock:
            self._kept[capture] = folder
            while len(self._kept) > KEPT_CAPTURES:
                _, oldest = self._kept.popitem(last=False)
                shutil.rmtree(oldest, ignore_errors=True)
        return capture, folder

    def file(self, capture: str, name: str) -> Path | None:
        """The file `name` of `capture`, or None (never a path outside the capture's folder)."""
        with self._lock:
            folder = self._kept.get(capture)
        if folder is None or name != _safe(name):
            return None
        path = folder / name
        return path if path.is_file() else None

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _safe(name: str) -> str:
    return _SAFE_NAME.sub("_", name).lstrip(".") or "file"


def _errors(exc: LocalCallError, address: str) -> list[dict[str, str]]:
    return [{"host": address, "error": str(exc)}]


class Actions:
    def __init__(
        self, control: ControlService, address: str, jobs: JobQuestions | None = None
    ) -> None:
        self.control = control
        self.address = address
        self.jobs = jobs  # the job's other daemons, for ranks on other nodes
        self.captures = Captures()

    def profile(self, job_id: str, steps: int) -> dict[str, Any]:
        """`plait profile --job JOB --steps N --json`, the trace kept for download."""
        context: Any = LocalContext()
        request = control_pb2.ProfileRequest(
            job_id=job_id, steps=steps, timeout_seconds=PROFILE_TIMEOUT_SECONDS
        )
        try:
            prepared = self.control.PrepareProfile(request, context)
            collected = self.control.CollectProfile(
                control_pb2.CollectProfileRequest(
                    request_id=prepared.request_id, timeout_seconds=PROFILE_TIMEOUT_SECONDS
                ),
                context,
            )
        except LocalCallError as exc:
            return {"file": None, "errors": _errors(exc, self.address)}
        capture, folder = self.captures.new()
        name = _safe(f"{job_id}-profile-step{collected.start_step}.json.gz")
        (folder / name).write_bytes(collected.trace_json_gz)
        return profile_document(
            output=f"files/{capture}/{name}",
            response=collected,
            analysis=collected.analysis,
            outcomes=[*prepared.outcomes, *collected.outcomes],
            errors=[],
        )

    def memory(self, job_id: str) -> dict[str, Any]:
        """`plait memory --job JOB --json`, each rank's files kept for download."""
        context: Any = LocalContext()
        request = control_pb2.MemoryRequest(job_id=job_id, step_wait_seconds=MEMORY_WAIT_SECONDS)
        try:
            response = self.control.Memory(request, context)
        except LocalCallError as exc:
            return {"files": [], "ranks": [], "outcomes": [], "errors": _errors(exc, self.address)}
        capture, folder = self.captures.new()
        written, reports = [], []
        for file in response.files:
            # A fault-tolerant job's groups each have a rank 0: their files are named apart.
            group = replica_group_of(file)
            name = _safe(f"{rank_file_prefix(group, file.rank)}.{file.name}")
            (folder / name).write_bytes(file.data)
            written.append(f"files/{capture}/{name}")
            if file.name == "memory.json":
                report = json.loads(file.data)
                if group != NO_REPLICA_GROUP:
                    report["replica_group"] = group
                reports.append((file.rank, report))
        reports.sort(key=lambda r: (r[1].get("replica_group", NO_REPLICA_GROUP), r[0]))
        return {
            "files": written,
            "ranks": [{"rank": rank, **report} for rank, report in reports],
            "outcomes": [daemon_json.message_dict(o) for o in response.outcomes],
            "errors": [],
        }

    def stacks(self, job_id: str, ranks: list[int]) -> dict[str, Any]:
        """`plait stacks --job JOB --ranks … --json`: every thread's stack of each rank, on
        whichever node of the job it runs (a hang's missing rank is often on another)."""
        context: Any = LocalContext()
        request = control_pb2.StacksRequest(
            job_id=job_id, ranks=ranks, timeout_seconds=STACKS_TIMEOUT_SECONDS
        )
        if self.jobs is not None and self.jobs.peers(job_id):
            return self._job_stacks(job_id, request)
        try:
            response = self.control.Stacks(request, context)
        except LocalCallError as exc:
            return {"ranks": [], "outcomes": [], "errors": _errors(exc, self.address)}
        return {
            "ranks": [daemon_json.message_dict(s) for s in response.ranks],
            "outcomes": [daemon_json.message_dict(o) for o in response.outcomes],
            "errors": [],
        }

    def _job_stacks(self, job_id: str, request: control_pb2.StacksRequest) -> dict[str, Any]:
        """The stacks from every daemon of the job (`AskJob`), each missing daemon named."""
        assert self.jobs is not None
        reply = self.jobs.ask(
            daemon_pb2.AskJobRequest(
                job_id=job_id,
                questions=[
                    daemon_pb2.JobQuestion(
                        method="Control/Stacks", request=request.SerializeToString()
                    )
                ],
                deadline_seconds=STACKS_TIMEOUT_SECONDS + JOB_MARGIN_SECONDS,
            )
        )
        ranks, outcomes, errors = [], [], []
        for answer in reply.answers:
            where = answer.address or self.address
            if answer.error:
                errors.append({"host": where, "error": answer.error})
                continue
            response = control_pb2.StacksResponse.FromString(answer.responses[0])
            ranks += [daemon_json.message_dict(s) for s in response.ranks]
            outcomes += [daemon_json.message_dict(o) for o in response.outcomes]
        return {"ranks": ranks, "outcomes": outcomes, "errors": errors}

    def close(self) -> None:
        self.captures.close()
