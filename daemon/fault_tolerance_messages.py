"""Fault-tolerant jobs and the hosted lighthouse as `plait.v1` messages (`plait status`).

What a replica group's state means is decided in `plait.daemon.replica_groups`; this module
only translates, and reads the lighthouse the daemon hosts (`plait.daemon.lighthouse`) when
asked, so a group that stopped heartbeating shows while the quorum is still waiting for it.
"""

from __future__ import annotations

from plait.daemon.lighthouse import parse_replica_id, read_lighthouse
from plait.daemon.quorum_log import QuorumEventRecord
from plait.daemon.replica_groups import FaultToleranceView, ReplicaGroupView
from plait.proto.plait.v1 import daemon_pb2

# The lighthouse answers from the daemon's own process: a slow answer means it is stuck.
LIGHTHOUSE_READ_TIMEOUT_SECONDS = 2.0


def replica_group_message(view: ReplicaGroupView) -> daemon_pb2.ReplicaGroupStatus:
    return daemon_pb2.ReplicaGroupStatus(
        replica_group=view.replica_group,
        state=view.state,
        ranks=view.ranks,
        ranks_live=view.ranks_live,
        step=view.step,
        replica_id=view.replica_id,
        quorum_id=view.quorum_id,
        participants=view.participants,
        world_size=view.world_size,
        restarts=view.restarts,
    )


def quorum_event_message(event: QuorumEventRecord) -> daemon_pb2.QuorumEvent:
    figures = event.figures
    return daemon_pb2.QuorumEvent(
        replica_group=event.replica_group,
        kind=figures.event,
        step=event.step,
        quorum_id=figures.quorum_id,
        participants=figures.participants,
        previous=figures.previous,
        start_unix_nano=event.start_ns,
        seconds=event.seconds,
        detail=figures.detail,
        replica_id=figures.replica_id,
    )


def fault_tolerant_job_message(view: FaultToleranceView) -> daemon_pb2.FaultTolerantJob:
    return daemon_pb2.FaultTolerantJob(
        job_id=view.job_id,
        state=view.state,
        groups=[replica_group_message(g) for g in view.groups],
        quorum_id=view.quorum_id,
        participants=view.participants,
        events=[quorum_event_message(e) for e in view.events],
        events_received=view.events_received,
    )


def lighthouse_message(
    address: str, *, timeout: float = LIGHTHOUSE_READ_TIMEOUT_SECONDS
) -> daemon_pb2.LighthouseStatus:
    """The hosted lighthouse's status page, read now; `error` says why when it cannot be."""
    try:
        view = read_lighthouse(address, timeout=timeout)
    except (OSError, ValueError) as error:
        return daemon_pb2.LighthouseStatus(address=address, quorum_id=-1, error=str(error))
    heartbeats = []
    for replica_id, age in sorted(view.heartbeats.items()):
        job, group = parse_replica_id(replica_id) or ("", -1)
        heartbeats.append(
            daemon_pb2.LighthouseHeartbeat(
                replica_id=replica_id, job_id=job, replica_group=group, age_seconds=age
            )
        )
    return daemon_pb2.LighthouseStatus(
        address=address,
        quorum_id=view.quorum_id,
        heartbeats=heartbeats,
        waiting=view.waiting,
        next_quorum=view.next_quorum,
    )
