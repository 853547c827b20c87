"""A job of thousands of ranks on one page: step times per node and their histogram.

The page lists the slowest ranks first (at most a screenful); what it cannot list, it draws:
the job's step times as a histogram, and each node's ranks summed up in one row (median,
slowest, which rank), slowest node first. Computed here, from the rank rows of `plait top
--json`, so the page only draws what the daemon sent.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = ["step_time_overview"]

HISTOGRAM_BINS = 20
NODES_SHOWN = 16


def _histogram(values: list[float], bins: int) -> dict[str, list[float] | list[int]]:
    low, high = min(values), max(values)
    width = (high - low) / bins if high > low else 1.0
    counts = [0] * bins
    for value in values:
        counts[min(int((value - low) / width), bins - 1)] += 1
    return {"edges": [low + i * width for i in range(bins + 1)], "counts": counts}


def step_time_overview(ranks: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """job id -> {"histogram": {edges, counts}, "nodes": [{host, ranks, median, slowest,
    slowest_rank}] slowest first (at most `NODES_SHOWN`), "node_count"}; step times in
    seconds, of the ranks that have one."""
    by_job: dict[str, dict[str, list[tuple[float, int]]]] = {}
    for rank in ranks:
        seconds = rank.get("step_seconds") or 0.0
        if seconds > 0:
            nodes = by_job.setdefault(rank["job_id"], {})
            nodes.setdefault(rank.get("host", ""), []).append((seconds, rank["rank"]))
    out = {}
    for job_id, nodes in sorted(by_job.items()):
        rows = []
        for host, steps in nodes.items():
            slowest, slowest_rank = max(steps)
            rows.append(
                {
                    "host": host,
                    "ranks": len(steps),
                    "median": statistics.median(s for s, _ in steps),
                    "slowest": slowest,
                    "slowest_rank": slowest_rank,
                }
            )
        rows.sort(key=lambda row: (-row["slowest"], row["host"]))
        values = [s for steps in nodes.values() for s, _ in steps]
        out[job_id] = {
            "histogram": _histogram(values, HISTOGRAM_BINS),
            "nodes": rows[:NODES_SHOWN],
            "node_count": len(rows),
        }
    return out
