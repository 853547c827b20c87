"""Hang reports and straggler scores as `plait.v1` messages, and back.

The servicer (`plait.daemon.service`) sends each daemon's hangs and stragglers with these. The
CLI judges both again over every daemon's answers: it reads the hangs back into `Hang` records
to merge them per collective (`plait.daemon.hangs.merge_hangs`), and scores the stragglers of
all hosts on one scale. They live apart from the servicer so that a client imports this, not
the daemon's server side (its store, analysis, exporters and ingest).
"""

from __future__ import annotations

from collections.abc import Sequence

from plait.daemon.hangs import Hang
from plait.daemon.stragglers import RankTiming, StragglerScore, score_ranks
from plait.proto.plait.v1 import daemon_pb2, metrics_pb2


def straggler_message(score: StragglerScore) -> metrics_pb2.StragglerScore:
    t = score.timing
    return metrics_pb2.StragglerScore(
        job_id=t.job_id,
        rank=t.rank,
        host=t.host,
        steps=t.steps,
        median_step_seconds=t.median_step_seconds,
        median_compute_seconds=t.median_compute_seconds,
        step_score=score.step_score,
        compute_score=score.compute_score,
        flagged=score.flagged,
    )


def hang_message(hang: Hang, hostname: str) -> metrics_pb2.CollectiveHang:
    return metrics_pb2.CollectiveHang(
        job_id=hang.job_id,
        group=hang.group,
        group_ranks=hang.group_ranks,
        op=hang.op,
        seq=hang.seq,
        purpose=hang.purpose,
        entered_ranks=hang.entered_ranks,
        missing_ranks=hang.missing_ranks,
        unreported_ranks=hang.unreported_ranks,
        entered_unix_nano=hang.entered_ns,
        waiting_seconds=hang.waiting_seconds,
        host=hostname,
        replica_group=hang.replica_group,
    )


def hang_from_message(message: metrics_pb2.CollectiveHang) -> Hang:
    return Hang(
        job_id=message.job_id,
        group=message.group,
        group_ranks=tuple(message.group_ranks),
        op=message.op,
        seq=message.seq,
        purpose=message.purpose,
        entered_ranks=tuple(message.entered_ranks),
        missing_ranks=tuple(message.missing_ranks),
        unreported_ranks=tuple(message.unreported_ranks),
        entered_ns=message.entered_unix_nano,
        waiting_seconds=message.waiting_seconds,
        replica_group=message.replica_group,
    )


def rescore_stragglers(
    responses: Sequence[daemon_pb2.GetBottleneckResponse], threshold: float
) -> list[metrics_pb2.StragglerScore]:
    """Score every host's ranks against the medians of all hosts' ranks (one job, one scale)."""
    timings = [
        RankTiming(
            job_id=s.job_id,
            rank=s.rank,
            host=s.host,
            steps=s.steps,
            median_step_seconds=s.median_step_seconds,
            median_compute_seconds=s.median_compute_seconds,
        )
        for response in responses
        for s in response.stragglers
    ]
    return [straggler_message(score) for score in score_ranks(timings, threshold)]
