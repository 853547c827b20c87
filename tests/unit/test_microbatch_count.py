"""The micro-batch count chosen when `train.micro_batch_size` is unset: rows x schedule -> count,
asked of the built-in schedules themselves, or a refusal naming the numbers and the field."""

from __future__ import annotations

import pytest

from plait.core.errors import ConfigError, ScheduleError
from plait.core.microbatch_count import default_microbatch_count
from plait.core.schedule import ScheduleRequest
from plait.plugins.pipeline.schedules import build_schedule


def choose(rows: int, schedule: str, pp: int, virtual: int = 1) -> int:
    def program(count: int) -> object:
        request = ScheduleRequest(
            name=schedule, num_microbatches=count, num_stages=pp, virtual_stages=virtual
        )
        return build_schedule(request)

    return default_microbatch_count(rows, num_stages=pp, schedule=schedule, program=program)


@pytest.mark.parametrize(
    ("rows", "schedule", "pp", "virtual", "expected"),
    [
        (8, "1f1b", 2, 1, 4),  # the smallest divisor >= 2 x pp
        (8, "zb_h1", 2, 1, 4),
        (8, "gpipe", 2, 1, 4),
        (12, "1f1b", 4, 1, 12),  # 6 would leave a bubble of a third; 12 is the first >= 8
        (6, "1f1b", 4, 1, 6),  # no divisor reaches 2 x pp: the largest the rows allow
        (2, "1f1b", 2, 1, 2),  # exactly the schedule's minimum
        (3, "1f1b", 2, 1, 3),
        (1, "gpipe", 2, 1, 1),  # GPipe runs any count
        (8, "interleaved_1f1b", 2, 2, 4),
        (6, "interleaved_1f1b", 2, 2, 6),  # 3 is not a multiple of pp; 6 is
        (8, "interleaved_1f1b", 4, 2, 8),
        (64, "1f1b", 8, 1, 16),
    ],
)
def test_count_for_rows_and_schedule(
    rows: int, schedule: str, pp: int, virtual: int, expected: int
) -> None:
    count = choose(rows, schedule, pp, virtual)
    assert count == expected
    assert rows % count == 0


def test_one_stage_keeps_the_whole_batch_without_asking_the_schedule() -> None:
    def program(count: int) -> object:
        raise AssertionError(f"asked for {count} micro-batches")

    assert default_microbatch_count(8, num_stages=1, schedule="accumulate", program=program) == 1


def test_any_schedule_states_its_own_counts() -> None:
    """A schedule from another package is asked, not looked up: this one runs multiples of 3."""

    def program(count: int) -> object:
        if count % 3:
            raise ScheduleError(f"'thirds' runs multiples of 3, got {count}")
        return []

    assert default_microbatch_count(12, num_stages=2, schedule="thirds", program=program) == 6
    assert default_microbatch_count(3, num_stages=2, schedule="thirds", program=program) == 3


def test_fewer_rows_than_the_schedule_needs_is_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError) as refused:
        choose(3, "1f1b", 4)
    message = str(refused.value)
    assert "train.micro_batch_size is unset" in message
    assert "batch of 3 rows" in message and "'1f1b' with pp=4" in message
    assert "needs at least 4 micro-batches" in message
    assert "give each rank 4 rows" in message
    # the schedule's own reason is kept
    assert "needs at least as many micro-batches as stages" in message


def test_rows_no_runnable_count_divides_are_refused_with_the_numbers() -> None:
    with pytest.raises(ConfigError) as refused:
        choose(6, "interleaved_1f1b", 4, 2)
    message = str(refused.value)
    assert "train.micro_batch_size" in message
    assert "none of the counts it runs (4, 8, 12, 16, 20, 24, ...) divides 6" in message
    assert "give each rank 8 rows" in message


def test_a_single_row_is_refused_for_two_stages() -> None:
    with pytest.raises(ConfigError, match=r"batch of 1 row into .* give each rank 2 rows"):
        choose(1, "1f1b", 2)


def test_a_set_micro_batch_size_the_schedule_cannot_run_names_the_field() -> None:
    """train.micro_batch_size = 8 of 8 rows is one micro-batch, fewer than 1F1B's two stages."""
    from types import SimpleNamespace

    from plait.core.engine import Engine
    from plait.core.errors import ConfigError, ScheduleError

    def one_f_one_b(count: int) -> list[str]:
        if count < 2:
            raise ScheduleError("schedule '1f1b' with pp=2 needs at least 2 micro-batches")
        return []

    engine = SimpleNamespace(
        config=SimpleNamespace(train=SimpleNamespace(micro_batch_size=8)),
        mesh=SimpleNamespace(size=lambda axis: 2 if axis == "pp" else 1),
        actions=one_f_one_b,
    )
    with pytest.raises(ConfigError, match=r"train.micro_batch_size = 8 splits this rank's 8 rows"):
        Engine.micro_batch_size(engine, 8)  # type: ignore[arg-type]
    engine.config.train.micro_batch_size = 4
    assert Engine.micro_batch_size(engine, 8) == 4  # type: ignore[arg-type]
