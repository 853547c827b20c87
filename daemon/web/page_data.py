"""What the page shows: `plait top --json` and `plait bottleneck --json` for the jobs this
daemon sees, across every node of each (their other daemons asked through `AskJob`), and the
hangs.

Nothing here computes a figure. The daemon's services are asked in-process (the same methods
the gRPC server calls, with `LocalContext` standing in for a call's context), and their answers
go through the very functions that build the CLI's documents (`plait.daemon.job_reports`:
`TopReport`, `top_document`, `bottleneck_report`, `bottleneck_document`; `merge_hangs`), so a
number on the page and the same number printed by `plait top --json --host <every daemon of
the job>` are one computation. The window and the straggler threshold are the CLI's defaults,
so both ask the same question. A job's other daemons that do not answer within
`PEER_DEADLINE_SECONDS` are listed as missing under `job_daemons` ("k/N daemons"), never
waited for.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from plait.daemon.config import DEFAULT_METRICS_WINDOW_STEPS
from plait.daemon.hangs import merge_hangs
from plait.daemon.job_questions import QUESTION_TYPES
from plait.daemon.job_reports import (
    TopReport,
    bottleneck_document,
    bottleneck_report,
    top_document,
)
from plait.daemon.local_calls import LocalContext
from plait.daemon.report_messages import hang_from_message
from plait.daemon.service import DaemonService
from plait.daemon.web.rank_overview import step_time_overview
from plait.proto.plait.v1 import daemon_pb2

# `plait top`'s and `plait bottleneck`'s default --window-steps.
WINDOW_STEPS = DEFAULT_METRICS_WINDOW_STEPS


# A peer daemon that has not answered by then is named missing on the page, not waited for.
PEER_DEADLINE_SECONDS = 1.5


@dataclass(frozen=True, slots=True)
class PageSource:
    """Where the page's figures come from: this daemon's service, as it is addressed, and the
    other daemons of the jobs it sees (`job_questions`: each job's directory)."""

    service: DaemonService
    address: str  # what `plait top --host` would be given
    straggler_threshold: float

    def document(self) -> dict[str, Any]:
        """The page's whole content now (see the module docstring for where each part is from):
        every node of every job this daemon sees, as `plait top --host <each daemon>` would."""
        context: Any = LocalContext()
        service = self.service
        metrics = service.GetMetrics(
            daemon_pb2.GetMetricsRequest(window_steps=WINDOW_STEPS), context
        )
        answers = {
            self.address: (
                service.GetBottleneck(
                    daemon_pb2.GetBottleneckRequest(
                        window_steps=WINDOW_STEPS, straggler_threshold=self.straggler_threshold
                    ),
                    context,
                ),
                service.ListRanks(daemon_pb2.ListRanksRequest(), context),
                metrics,
            )
        }
        hangs = service.hangs()
        coverage = []
        for job_id in sorted({job.job_id for job in metrics.jobs}):
            peers = self._peers(job_id)
            if peers is None:
                continue
            answers.update(peers.answers)
            hangs += [hang_from_message(h) for status in peers.statuses for h in status.hangs]
            coverage.append(peers.coverage)
        latest: dict[str, Any] = {label: triple[2] for label, triple in answers.items()}
        top = top_document(TopReport.from_latest(latest))
        breakdown, _ = bottleneck_report(answers, self.straggler_threshold)
        return {
            "address": self.address,
            "computed_unix_nano": metrics.computed_unix_nano,
            "window_steps": WINDOW_STEPS,
            "top": top,
            "bottleneck": bottleneck_document(breakdown, None),
            "hangs": [asdict(h) for h in merge_hangs(hangs)],
            "job_daemons": coverage,
            "step_times": step_time_overview(top["ranks"]),
        }

    def _peers(self, job_id: str) -> PeerAnswers | None:
        """What the other daemons of `job_id` answer (None for a job on this node alone)."""
        questions = self.service.extras.job_questions
        if questions is None:
            return None
        asked = [
            ("Daemon/GetBottleneck", daemon_pb2.GetBottleneckRequest(
                job_id=job_id, window_steps=WINDOW_STEPS,
                straggler_threshold=self.straggler_threshold)),
            ("Daemon/ListRanks", daemon_pb2.ListRanksRequest(job_id=job_id)),
            ("Daemon/GetMetrics", daemon_pb2.GetMetricsRequest(
                job_id=job_id, window_steps=WINDOW_STEPS)),
            ("Daemon/Status", daemon_pb2.StatusRequest()),
        ]  # fmt: skip
        answers = questions.ask_others(job_id, asked, PEER_DEADLINE_SECONDS)
        if not answers:
            return None
        found: dict[str, Any] = {}
        missing = []
        statuses = []
        for answer in answers:
            if answer.error:
                missing.append({"node": answer.node, "address": answer.address,
                                "error": answer.error})  # fmt: skip
                continue
            bottleneck, ranks, metrics, status = (
                QUESTION_TYPES[method][1].FromString(data)
                for (method, _), data in zip(asked, answer.responses, strict=True)
            )
            found[answer.address] = (bottleneck, ranks, metrics)
            statuses.append(status)
        coverage = {
            "job_id": job_id,
            "asked": len(answers) + 1,  # and this daemon
            "answered": len(found) + 1,
            "missing": missing,
        }
        return PeerAnswers(found, statuses, coverage)


@dataclass(frozen=True, slots=True)
class PeerAnswers:
    """The other daemons of one job: (bottleneck, ranks, metrics) by address, their statuses
    (for their hangs), and the page's "k/N daemons" record."""

    answers: dict[str, Any]
    statuses: list[daemon_pb2.StatusResponse]
    coverage: dict[str, Any]
