"""A pytest plugin that appends each test's outcome to a JSON-lines file as soon as it is known.

    PLAIT_TEST_OUTCOMES=outcomes.jsonl python -m pytest -p plait.tools.pytest_outcomes …

One line per test: `{"test", "outcome", "seconds", "reason"}` (outcome: passed, failed, error or
skipped; an error is a failure outside the test's call, in its fixtures). Unlike a JUnit report,
written once at the end, the file keeps every finished test when the run is killed part-way
(`tools/gpu_check.py` caps each stage).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

ENV = "PLAIT_TEST_OUTCOMES"
REASON_CHARS = 1500


def _reason(report: pytest.TestReport) -> str:
    if report.passed:
        return ""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2])[:REASON_CHARS]
    text = getattr(report, "longreprtext", "") or str(report.longrepr or "")
    return text[-REASON_CHARS:]


def _outcome(report: pytest.TestReport) -> str | None:
    """The test's outcome from this phase's report, or None while it is still undecided."""
    if report.when == "call":
        return "failed" if report.failed else ("skipped" if report.skipped else "passed")
    if report.failed:
        return "error"
    if report.skipped:
        return "skipped"
    return None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = os.environ.get(ENV)
    outcome = _outcome(report)
    if not path or outcome is None:
        return
    if report.when == "teardown" and outcome != "error":
        return  # the call phase already said how it went
    line = {
        "test": report.nodeid,
        "outcome": outcome,
        "phase": report.when,
        "seconds": round(report.duration, 2),
        "reason": _reason(report),
    }
    with Path(path).open("a") as outcomes:
        outcomes.write(json.dumps(line) + "\n")
