"""How far a fault-tolerant job had come before this replica group joined it.

A replacement group that finds no live peer at its first quorum and has no checkpoint would
train the job from its initial weights. torchrun's restart count tells a restarted group from a
new one, but not a replacement started by hand or by a scheduler (a fresh process, a fresh run
directory). The lighthouse does know: its status page keeps the members of the last quorum it
formed, with the step each asked at, after they died. Read once, before this group's own first
quorum replaces that record, by the group's rank 0 and shared with its other ranks, so every
rank of the group decides alike.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch.distributed as dist

# Long enough for a loaded lighthouse; the read happens once per start.
READ_TIMEOUT_SECONDS = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class JobProgress:
    """The furthest member of the job in the lighthouse's last quorum."""

    job_id: str
    step: int
    replica_id: str


def job_progress_at(lighthouse: str, job_id: str) -> JobProgress | None:
    """The job's furthest group in the lighthouse's last quorum; None when none of the job's
    groups is in it. Raises `OSError` when the page cannot be read."""
    from plait.daemon.lighthouse import parse_replica_id, read_lighthouse

    members = read_lighthouse(lighthouse, timeout=READ_TIMEOUT_SECONDS).previous_quorum
    ours = {
        replica: step
        for replica, step in members.items()
        if (parse_replica_id(replica) or ("", -1))[0] == job_id
    }
    if not ours:
        return None
    replica = max(ours, key=lambda r: ours[r])
    return JobProgress(job_id=job_id, step=ours[replica], replica_id=replica)


def agree_on_job_progress(lighthouse: str, job_id: str) -> JobProgress | None:
    """`job_progress_at`, read by the group's rank 0 and broadcast over the group (collective
    over the group's ranks). An unreadable page is said once and taken as unknown (None)."""
    found: list[JobProgress | None] = [None]
    if dist.get_rank() == 0:
        try:
            found[0] = job_progress_at(lighthouse, job_id)
        except (OSError, ValueError) as exc:
            print(
                f"plait: could not read the lighthouse's last quorum at {lighthouse} ({exc}); "
                "a replacement group alone at step 0 cannot be told from a new run",
                file=sys.stderr,
            )
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(found, src=0)
    return found[0]


def lighthouse_answers(lighthouse: str) -> bool:
    """Whether the lighthouse's status page can be read now."""
    from plait.daemon.lighthouse import read_lighthouse

    try:
        read_lighthouse(lighthouse, timeout=READ_TIMEOUT_SECONDS)
    except (OSError, ValueError):
        return False
    return True
