"""How many micro-batches a rank's batch is split into when `train.micro_batch_size` is unset.

A pipeline keeps its stages busy with micro-batches: with `m` of them over `p` stages, GPipe and
1F1B leave every stage idle for a fraction (p - 1) / (m + p - 1) of the step (Narayanan et al.
2021, §2.2): about half at m = p, a third at m = 2p. More micro-batches cost no activation
memory (1F1B keeps at most p of them alive, GPipe the whole batch whatever m is); they cost
smaller matmuls and more point-to-point messages. torchtitan's default goes to the limit (one
row per micro-batch); plait stops at the first count past 2p, keeping micro-batches as large as
a bubble of at most a third allows:

- one pipeline stage: one micro-batch (no bubble to fill; accumulating would only cost time);
- else the smallest count that divides the rank's rows, that the schedule runs, and that is at
  least 2 x pp; when the rows allow none that large, the largest they allow;
- when they allow none at all (fewer rows than the schedule's minimum, or no count it runs
  divides them), a `ConfigError` with the numbers and the field to set.

Which counts a schedule runs is the schedule's own answer: a count is tried by asking for its
program, which raises `ScheduleError` for a count it cannot run (1F1B needs at least pp,
interleaved 1F1B a multiple of pp), so no rule is written twice::

    count = default_microbatch_count(8, num_stages=2, schedule="1f1b", program=engine.actions)
    micro_batch_size = 8 // count  # 4 micro-batches of 2 rows
"""

from __future__ import annotations

from collections.abc import Callable

from plait.core.errors import ConfigError, ScheduleError

ProgramBuilder = Callable[[int], object]
"""Builds the schedule's program for a number of micro-batches; raises `ScheduleError` for a
number the schedule cannot run."""

# When explaining a refusal, the counts a schedule runs are looked for up to this many times pp
# (the built-in schedules run every multiple of pp).
_SEARCH_STAGES = 8


def default_microbatch_count(
    rows: int, *, num_stages: int, schedule: str, program: ProgramBuilder
) -> int:
    """The number of micro-batches to split a rank's `rows` into (see the module docstring)."""
    if num_stages <= 1:
        return 1
    target = 2 * num_stages
    runnable: list[int] = []
    for count in _divisors(rows):
        if _refusal(program, count) is None:
            runnable.append(count)
            if count >= target:
                return count
    if runnable:
        return runnable[-1]
    raise _cannot_split(rows, num_stages=num_stages, schedule=schedule, program=program)


def _divisors(rows: int) -> list[int]:
    return [count for count in range(1, rows + 1) if rows % count == 0]


def _refusal(program: ProgramBuilder, count: int) -> str | None:
    """Why the schedule cannot run `count` micro-batches, or `None` if it can."""
    try:
        program(count)
    except ScheduleError as exc:
        return str(exc)
    return None


def _cannot_split(
    rows: int, *, num_stages: int, schedule: str, program: ProgramBuilder
) -> ConfigError:
    reason = _refusal(program, rows) or ""
    limit = _SEARCH_STAGES * num_stages
    runnable = [count for count in range(1, limit + 1) if _refusal(program, count) is None]
    rows_text = f"{rows} row{'s' if rows != 1 else ''}"
    head = (
        f"train.micro_batch_size is unset, so plait splits this rank's batch of {rows_text} "
        f"into micro-batches for schedule {schedule!r} with pp={num_stages}"
    )
    if not runnable:
        return ConfigError(f"{head}, but the schedule runs no count up to {limit} ({reason})")
    shown = ", ".join(map(str, runnable[:6])) + (", ..." if len(runnable) > 6 else "")
    smallest = runnable[0]
    if rows < smallest:
        problem = f"it needs at least {smallest} micro-batches, more than the batch has rows"
    else:
        problem = f"none of the counts it runs ({shown}) divides {rows}"
    fits = next(n for n in range(rows + 1, rows + limit + 1) if any(n % c == 0 for c in runnable))
    return ConfigError(
        f"{head}: {problem} ({reason}). No train.micro_batch_size splits {rows_text} that way: "
        f"give each rank {fits} rows, or any number that one of {shown} divides (with `plait "
        "train`, train.global_batch_size = rows per rank x data-parallel ranks)"
    )
