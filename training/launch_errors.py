"""A failed rank as one line: the root cause, with the full record kept in a log file.

Each rank started by torchrun has an error file (`$TORCHELASTIC_ERROR_FILE`); a rank that fails
writes its message and traceback there (`record_rank_error`) instead of printing them, so N
ranks failing alike do not print N copies. The launcher reads every failed rank's file, prints
the earliest failure as one line and writes torchrun's whole report plus every rank's
traceback to `launch.log` in the run directory (`failure_line`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.core.errors import PlaitError

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
LAUNCH_LOG = "launch.log"


def record_rank_error(exc: BaseException, env: Mapping[str, str]) -> bool:
    """Write `exc` to this rank's error file, in torchelastic's format; False when there is none
    (not launched by torchrun), so the caller prints it itself."""
    path = env.get(ERROR_FILE_ENV)
    if not path:
        return False
    message = str(exc) if isinstance(exc, PlaitError) else f"{type(exc).__name__}: {exc}"
    data = {
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": "".join(traceback.format_exception(exc)),
                "timestamp": str(int(time.time())),
                "timestamp_ns": str(time.time_ns()),
            },
        }
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data))
    return True


@dataclass(frozen=True, slots=True)
class RankFailure:
    rank: int
    exitcode: int
    message: str
    callstack: str
    timestamp_ns: int


def rank_failures(failures: Mapping[int, Any]) -> list[RankFailure]:
    """torchrun's `ProcessFailure`s by global rank, earliest first (those with a recorded
    message before the ranks that were only stopped)."""
    result = []
    for rank, failure in failures.items():
        data = failure.error_file_data if isinstance(failure.error_file_data, dict) else {}
        recorded = data.get("message")
        if isinstance(recorded, dict):
            extra = recorded.get("extraInfo", {})
            message = str(recorded.get("message", ""))
            callstack = str(extra.get("py_callstack", ""))
            stamp = int(extra.get("timestamp_ns", int(extra.get("timestamp", 0)) * 10**9))
        else:
            message = _exit_message(failure.exitcode, failure)
            callstack = ""
            stamp = 2**63 - 1  # no record: after every rank that said why it failed
        result.append(RankFailure(rank, failure.exitcode, message, callstack, stamp))
    return sorted(result, key=lambda f: (f.timestamp_ns, f.rank))


def _exit_message(exitcode: int, failure: Any) -> str:
    if exitcode < 0:
        return f"killed by {failure.signal_name()}"
    return f"exited with code {exitcode} without an error message (see the rank's output above)"


def launch_log_path(run_dir: str) -> Path:
    """`<run_dir>/launch.log`, or a new file in the temporary directory without a run dir."""
    if run_dir:
        directory = Path(run_dir).expanduser()
        directory.mkdir(parents=True, exist_ok=True)
        return directory / LAUNCH_LOG
    handle, name = tempfile.mkstemp(prefix="plait-launch-", suffix=".log")
    os.close(handle)
    return Path(name)


def failure_line(exc: Any, log_path: Path, launcher_lines: Sequence[str] = ()) -> str:
    """One line naming the first failed rank and its error; the full report goes to `log_path`:
    torchrun's log lines, its failure report, then every failed rank's message and traceback.

    `exc` is torchrun's `ChildFailedError` (its `failures` map global ranks to failures).
    """
    failures = rank_failures(exc.failures)
    sections = ["\n".join(launcher_lines)] if launcher_lines else []
    sections.append(exc.format_msg())
    for failure in failures:
        sections.append(
            f"rank {failure.rank} (exit code {failure.exitcode}): {failure.message}\n"
            + failure.callstack
        )
    with log_path.open("a") as log:
        log.write("\n\n".join(sections) + "\n")
    if not failures:
        return f"training failed: {exc} (full report: {log_path})"
    first, later = failures[0], failures[1:]
    alike = [f.rank for f in later if f.message == first.message]
    also = f"; rank{'s' if len(alike) > 1 else ''} {_ranks(alike)} alike" if alike else ""
    if len(later) > len(alike):
        others = len(later) - len(alike)
        also += f"; {others} other rank{'s' if others > 1 else ''} stopped after it"
    return f"rank {first.rank} failed: {first.message}{also} (full report: {log_path})"


def _ranks(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks[:8])) + (
        f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    )


class LaunchLog(logging.Handler):
    """torchrun's own log records (worker exit codes, "Sending process … closing signal") are
    kept while the ranks run, instead of printed, and written to the launch log on a failure."""

    LOGGERS = ("torch.distributed.elastic", "torch.distributed.run")

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        self.lines: list[str] = []
        self._previous: dict[str, tuple[bool, list[logging.Handler]]] = {}

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(self.format(record))

    def __enter__(self) -> LaunchLog:
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            self._previous[name] = (logger.propagate, list(logger.handlers))
            for handler in list(logger.handlers):
                logger.removeHandler(handler)
            logger.addHandler(self)
            logger.propagate = False
        return self

    def __exit__(self, *exc: object) -> None:
        for name, (propagate, handlers) in self._previous.items():
            logger = logging.getLogger(name)
            logger.removeHandler(self)
            for handler in handlers:
                logger.addHandler(handler)
            logger.propagate = propagate
