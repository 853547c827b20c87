"""Recording rules for a job across many daemons, evaluated by Prometheus, not by plait.

Each daemon publishes its own share of a job (`plait.daemon.points`): its ranks' tokens/s,
their achieved and peak FLOP/s, each rank's step time. One Prometheus scraping every daemon of
the job (`plait prometheus-targets`) adds them up the way `plait top --host … --host …` does:

* `plait:job_tokens_per_second` — the daemons' tokens/s, summed;
* `plait:job_mfu:ratio` — summed achieved FLOP/s over summed peak FLOP/s (`plait.daemon.mfu`);
* `plait:rank_straggler_score:ratio` — each rank's step time over the median step time of
  every rank of the job, minus one (0.3: 30 % slower than the job's median rank).

`plait prometheus-rules` writes them as a rules file (`rule_files:` in prometheus.yml).
"""

from __future__ import annotations

from plait.daemon import telemetry_schema as schema
from plait.daemon.exporters import KNOWN_POINTS, prometheus_name

__all__ = ["RECORDED", "recording_rules"]

JOB = schema.RESOURCE_JOB_ID.replace(".", "_")  # the job label, as Prometheus spells it


def _series(name: str) -> str:
    counter, unit = KNOWN_POINTS[name]
    return prometheus_name(name, unit, counter)


# The recorded series, and the PromQL that makes each.
RECORDED: dict[str, str] = {
    "plait:job_tokens_per_second": (f"sum by ({JOB}) ({_series('plait.job.tokens_per_second')})"),
    "plait:job_flops_achieved:sum": f"sum by ({JOB}) ({_series('plait.job.flops.achieved')})",
    "plait:job_flops_peak:sum": f"sum by ({JOB}) ({_series('plait.job.flops.peak')})",
    "plait:job_mfu:ratio": "plait:job_flops_achieved:sum / plait:job_flops_peak:sum",
    "plait:rank_straggler_score:ratio": (
        f"{_series('plait.rank.step.duration')} / on ({JOB}) group_left () "
        f"quantile by ({JOB}) (0.5, {_series('plait.rank.step.duration')}) - 1"
    ),
}


def recording_rules(interval_seconds: float = 15.0) -> str:
    """The rules file (YAML), one group evaluated every `interval_seconds`."""
    lines = ["groups:", "  - name: plait-jobs", f"    interval: {interval_seconds:g}s"]
    lines.append("    rules:")
    for record, expr in RECORDED.items():
        lines += [f"      - record: {record}", f"        expr: {expr}"]
    return "\n".join(lines) + "\n"
