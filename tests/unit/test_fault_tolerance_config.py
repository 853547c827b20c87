"""`[fault_tolerance]`: what a replica group's settings accept, what they refuse and how they
split the data; the quorum events a group's steps report; the replica group the engine's job
starts with."""

from __future__ import annotations

from typing import Any

import pytest

from plait.core.config import load_config
from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.plugins import Plugins
from plait.daemon.lighthouse import (
    HostedLighthouse,
    LighthouseSettings,
    parse_lighthouse_status,
    read_lighthouse,
)
from plait.daemon.security import SecurityError
from plait.plugins.fault_tolerance.config import fault_tolerance_config
from plait.plugins.fault_tolerance.data_share import replica_data_coordinates
from plait.plugins.fault_tolerance.quorum_events import QuorumWatch

GROUP_1_OF_2 = [
    "fault_tolerance.replica_group=1",
    "fault_tolerance.replica_groups=2",
    "fault_tolerance.lighthouse=127.0.0.1:29510",
]


def test_off_by_default_and_on_with_a_group_and_a_lighthouse() -> None:
    assert not fault_tolerance_config(load_config()).enabled
    settings = fault_tolerance_config(load_config(overrides=GROUP_1_OF_2))
    assert settings.enabled and settings.lighthouse == "127.0.0.1:29510"


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["fault_tolerance.replica_group=2", "fault_tolerance.replica_groups=2"], "0 .. 1"),
        (["fault_tolerance.replica_group=0", "fault_tolerance.lighthouse=host"], "HOST:PORT"),
        (["fault_tolerance.replica_group=0", "fault_tolerance.lighthouse=h:99999"], "HOST:PORT"),
        (["fault_tolerance.replica_group=-2"], "fault_tolerance.replica_group"),
        ([*GROUP_1_OF_2, "fault_tolerance.min_replica_groups=3"], "allowed: 1 .. 2"),
        ([*GROUP_1_OF_2, "fault_tolerance.step_timeout_seconds=0"], "step_timeout_seconds"),
        ([*GROUP_1_OF_2, "fault_tolerance.replica_gruop=1"], "did you mean 'replica_group'"),
    ],
)
def test_a_bad_value_names_the_field_and_what_is_allowed(overrides: list[str], named: str) -> None:
    with pytest.raises(ConfigError, match="fault_tolerance") as error:
        fault_tolerance_config(
            load_config(overrides=["fault_tolerance.lighthouse=127.0.0.1:1", *overrides])
        )
    assert named in str(error.value)


def test_groups_split_the_global_batch_group_major() -> None:
    settings = fault_tolerance_config(load_config(overrides=GROUP_1_OF_2))
    # Group 1's dp rank 0 of 2 reads what rank 2 of a 4-rank job would.
    assert replica_data_coordinates(dp_rank=0, dp_size=2, settings=settings) == (2, 4)
    off = fault_tolerance_config(load_config())
    assert replica_data_coordinates(dp_rank=1, dp_size=2, settings=off) == (1, 2)


def test_the_watch_reports_joins_leaves_heals_and_failed_commits_once() -> None:
    watch = QuorumWatch()
    watch.quorum(quorum_id=1, participants=2, step=0, start_ns=0, end_ns=10)
    watch.quorum(quorum_id=1, participants=2, step=1, start_ns=10, end_ns=20)
    assert [(e.kind, e.previous, e.participants) for e in watch.take()] == [("join", 0, 2)]
    watch.failed_commit(
        step=2, quorum_id=1, participants=2, start_ns=20, end_ns=50, error="peer reset"
    )
    watch.quorum(quorum_id=2, participants=1, step=2, start_ns=50, end_ns=2_050_000_050)
    events = watch.take()
    assert [(e.kind, e.step) for e in events] == [("failed_commit", 2), ("leave", 2)]
    assert events[1].seconds == pytest.approx(2.05) and "left (2 -> 1" in events[1].describe()
    watch.healed_to(7)
    watch.quorum(quorum_id=3, participants=2, step=0, start_ns=0, end_ns=5)
    assert [(e.kind, e.step) for e in watch.take()] == [("join", 0), ("heal", 7)]
    assert watch.take() == ()


def test_the_lighthouse_listens_on_loopback_unless_the_network_is_trusted() -> None:
    with pytest.raises(SecurityError, match="no TLS or token; pass --insecure"):
        LighthouseSettings(bind="0.0.0.0:29510")
    assert LighthouseSettings(bind="0.0.0.0:29510", insecure=True).insecure
    with pytest.raises(ValueError, match="heartbeat_timeout_seconds"):
        LighthouseSettings(bind="127.0.0.1:0", heartbeat_timeout_seconds=0)


def test_a_hosted_lighthouse_answers_on_the_address_it_reports() -> None:
    lighthouse = HostedLighthouse(LighthouseSettings(bind="127.0.0.1:0"))
    try:
        assert lighthouse.address.startswith("127.0.0.1:")
        view = read_lighthouse(lighthouse.address)
        assert view.heartbeats == {} and view.waiting == 0 and "not ready" in view.next_quorum
    finally:
        lighthouse.stop()


def test_the_status_page_is_read_whatever_unit_its_heartbeat_ages_are_in() -> None:
    page = (
        "Current quorum_id: 3 <br>\nNext quorum status: New quorum not ready, only have 1 "
        "participants [1/1 participants healthy][2 heartbeating]\n<h2>Heartbeats</h2>\n<ul>\n"
        '  <li class="heartbeat">\n    job-group0:a1: seen 3.5µs ago\n  </li>\n'
        '  <li class="heartbeat">\n    job-group1:b2: seen 2.5ms ago\n  </li>\n'
        '  <li class="heartbeat old">\n    job-group1:c3: seen 7.25s ago\n  </li>\n</ul>'
    )
    view = parse_lighthouse_status(page)
    assert view.quorum_id == 3 and view.waiting == 1
    assert view.heartbeats == pytest.approx(
        {"job-group0:a1": 3.5e-6, "job-group1:b2": 2.5e-3, "job-group1:c3": 7.25}
    )


# torchft 0.2's page after a quorum of two groups (one recovering), as a lighthouse served it.
PREVIOUS_QUORUM_PAGE = """
Current quorum_id: 2 <br>
Next quorum status: New quorum not ready [0/0 participants healthy][2 heartbeating]

<h3>Previous Quorum</h3>
Previous quorum id: 2 <br>
Num participants: 2 <br>
<div>
<div class="member
 recovering
">
  <b>J-group0:89f72b5d-aca3-4287-8008-ef3e16e393ec</b> <br/>
  Step: 0 <br/>
  Manager: http://127.0.0.1:38903 <br/>
</div>
<div class="member
">
  <b>J-group1:826cca92-9a4f-474b-b68c-4d995798770c</b> <br/>
  Step: 18 <br/>
  Manager: http://127.0.0.1:34779 <br/>
</div>
</div>
<h2>Heartbeats</h2>
<ul>
  <li class="heartbeat">
    J-group0:89f72b5d-aca3-4287-8008-ef3e16e393ec: seen 0.051658082s ago
  </li>
</ul>
"""


def test_the_previous_quorums_members_and_steps_are_read() -> None:
    view = parse_lighthouse_status(PREVIOUS_QUORUM_PAGE)
    assert view.previous_quorum == {
        "J-group0:89f72b5d-aca3-4287-8008-ef3e16e393ec": 0,
        "J-group1:826cca92-9a4f-474b-b68c-4d995798770c": 18,
    }
    assert parse_lighthouse_status("Current quorum_id: -1 <br>").previous_quorum == {}


def test_a_jobs_progress_is_its_furthest_group_in_the_last_quorum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from plait.daemon import lighthouse
    from plait.plugins.fault_tolerance.job_progress import job_progress_at

    page = PREVIOUS_QUORUM_PAGE.replace("<b>J-group0", "<b>other-job-group0").replace(
        "Step: 0", "Step: 99"
    )
    monkeypatch.setattr(
        lighthouse, "read_lighthouse", lambda *_, **__: parse_lighthouse_status(page)
    )
    found = job_progress_at("127.0.0.1:1", "J")
    assert found is not None and (found.step, found.replica_id.split(":")[0]) == (18, "J-group1")
    assert job_progress_at("127.0.0.1:1", "nobody") is None


class _JobStarts:
    """Keeps the `JobInfo` every `plait_job_start` is given (what telemetry builds from)."""

    def __init__(self) -> None:
        self.infos: list[Any] = []

    @hookimpl
    def plait_job_start(self, info: Any) -> None:
        self.infos.append(info)


@pytest.mark.parametrize(("overrides", "group"), [(GROUP_1_OF_2, 1), ([], -1)])
def test_the_engine_starts_the_job_with_the_replica_group_the_section_names(
    overrides: list[str], group: int
) -> None:
    """From construction on, before any fault-tolerant step is attached: telemetry's resource
    and the daemon key the rank by its group from `plait_job_start`."""
    from plait.core.engine import Engine

    starts = _JobStarts()
    config = load_config(
        {
            "model": {"name": "llama", "size": "tiny"},
            "data": {"seq_len": 16},
            "train": {"steps": 1, "global_batch_size": 2, "device": "cpu"},
            "telemetry": {"enabled": False},
        },
        overrides,
    )
    engine = Engine(config=config, plugins=Plugins.create(extra=[("job_starts", starts)]))
    try:
        assert [info.replica_group for info in starts.infos] == [group]
        assert engine.job_info().replica_group == group
    finally:
        engine.close()
