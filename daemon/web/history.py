"""MFU over time: the figures of each pushed document, kept for the last hour.

The samples are the `mfu` of `plait top --json`'s jobs and ranks at each push, not figures of
their own; a page opened late gets the hour it missed before the live updates.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

DEFAULT_HISTORY_SECONDS = 3600.0


class MfuHistory:
    """A ring of (time, job MFU by job, rank MFU by "job/rank"), newest last."""

    def __init__(self, capacity: int) -> None:
        self._samples: deque[dict[str, Any]] = deque(maxlen=max(capacity, 1))
        self._lock = threading.Lock()

    def add(self, document: dict[str, Any]) -> dict[str, Any]:
        """Record `document`'s MFU figures; returns the sample."""
        top = document["top"]
        sample = {
            "t": document["computed_unix_nano"] / 1e9,
            "jobs": {j["job_id"]: j["mfu"] for j in top["jobs"]},
            "ranks": {f"{r['job_id']}/{r['rank']}": r["mfu"] for r in top["ranks"]},
        }
        with self._lock:
            self._samples.append(sample)
        return sample

    def samples(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._samples)
