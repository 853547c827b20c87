"""A plugin selected by name must act: an inert one stops the run (or, asked to, warns once).

Three third-party plugins (`inert_plugin_workers`) register a comm algorithm, a kernel provider
and a schedule, and take over nothing. On 2 Gloo ranks, in one spawn: each, selected, stops
the run at the end of step 1 with an error naming the plugin and what it was offered; with
`plugins.inert_selection = "warn"` rank 0 says so once and the run trains on the defaults; an
algorithm that does act (the built-in ring) and a preferred provider that answers are left be.
"""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist.inert_plugin_workers import STEPS, run_cases

pytestmark = pytest.mark.dist

WARN = {"plugins": {"inert_selection": "warn"}}
CASES = {
    "comm": {"comm": {"algorithm": "int8_stale"}},
    "comm_warn": {"comm": {"algorithm": "int8_stale"}, **WARN},
    "kernel": {"kernels": {"prefer": ["cpu_stale"]}},
    "schedule": {"schedule": {"name": "reverse_stale"}},
    "schedule_warn": {"schedule": {"name": "reverse_stale"}, **WARN},
    "acting": {"comm": {"algorithm": "ring"}, "kernels": {"prefer": ["torch"]}},
}


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, tuple]]:
    return run_distributed(run_cases, 2, CASES, timeout=240)


@pytest.mark.timeout(300)
def test_an_inert_comm_algorithm_stops_the_run_naming_what_it_was_offered(
    outcomes: list[dict[str, tuple]],
) -> None:
    for rank in outcomes:
        kind, message, steps_done, warnings = rank["comm"]
        assert (kind, steps_done, warnings) == ("error", 0, [])
        assert "comm.algorithm = 'int8_stale' selects 'int8_stale' (registered in code)" in message
        assert "took over none of the" in message and "in step 1" in message
        assert "all_reduce (grad_bucket) ×" in message
        assert "plugins.inert_selection = 'warn'" in message


@pytest.mark.timeout(300)
def test_an_inert_kernel_provider_and_schedule_stop_the_run(
    outcomes: list[dict[str, tuple]],
) -> None:
    for rank in outcomes:
        kind, message, steps_done, _ = rank["kernel"]
        assert (kind, steps_done) == ("error", 0)
        assert "kernels.prefer names provider 'cpu_stale' of 'cpu_stale' (registered in code)" in (
            message
        )
        assert "rms_norm on cpu/float32" in message and "torch answered instead" in message
        kind, message, steps_done, _ = rank["schedule"]
        assert (kind, steps_done) == ("error", 0)
        assert "schedule.name = 'reverse_stale' selects 'reverse_stale'" in message
        assert "answered nothing when offered ScheduleRequest(name='reverse_stale'" in message


@pytest.mark.timeout(300)
def test_warn_says_so_once_on_rank_0_and_trains_on_the_defaults(
    outcomes: list[dict[str, tuple]],
) -> None:
    for case in ("comm_warn", "schedule_warn"):
        (kind, steps_done, warnings0), (_, _, warnings1) = (o[case] for o in outcomes)
        assert (kind, steps_done) == ("trained", STEPS), case
        assert len(warnings0) == 1 and warnings1 == [], (case, warnings0, warnings1)
        assert "Training goes on with the default." in warnings0[0]
    assert "int8_stale" in outcomes[0]["comm_warn"][2][0]
    assert "reverse_stale" in outcomes[0]["schedule_warn"][2][0]


@pytest.mark.timeout(300)
def test_selected_plugins_that_act_are_left_be(outcomes: list[dict[str, tuple]]) -> None:
    for rank in outcomes:
        assert rank["acting"] == ("trained", STEPS, [])
