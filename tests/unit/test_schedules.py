"""Pipeline schedules as data: the built-in programs, the checker, the timeline and the CLI."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

import plait.plugins.pipeline as pipeline_plugin
from plait.core.errors import ScheduleError
from plait.core.plugins import Plugins
from plait.core.schedule import (
    Action,
    Backward,
    Forward,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ScheduleRequest,
    SendActivation,
    SendGrad,
    SyncGradients,
)
from plait.plugins.pipeline.checker import check_schedule
from plait.plugins.pipeline.schedules import SCHEDULES, build_programs
from plait.plugins.pipeline.timeline import (
    ActionCosts,
    render_png,
    render_text,
    simulate_timeline,
    theoretical_bubble_fraction,
)
from plait.tools.schedule_commands import app


def _valid_cases() -> list[tuple[str, int, int, int]]:
    """(schedule, stages, micro-batches, virtual stages) for every schedule, 1..8 stages."""
    cases = []
    for stages in range(1, 9):
        for microbatches in sorted({1, stages, stages + 1, 2 * stages, 3 * stages}):
            cases.append(("gpipe", stages, microbatches, 1))
            if microbatches >= stages:
                cases.append(("1f1b", stages, microbatches, 1))
                cases.append(("zb_h1", stages, microbatches, 1))
        if stages >= 2:
            for microbatches in (stages, 2 * stages, 3 * stages):
                for virtual in (2, 3):
                    cases.append(("interleaved_1f1b", stages, microbatches, virtual))
    return cases


@pytest.mark.parametrize(("name", "stages", "microbatches", "virtual"), _valid_cases())
def test_every_builtin_schedule_passes_the_checker(
    name: str, stages: int, microbatches: int, virtual: int
) -> None:
    programs = build_programs(
        name, num_microbatches=microbatches, num_stages=stages, virtual_stages=virtual
    )
    check_schedule(
        programs, num_microbatches=microbatches, num_stages=stages, virtual_stages=virtual
    )
    for rank, program in programs.items():
        assert program[-2:] == [SyncGradients(), OptimizerStep()]
        forwards = [a for a in program if isinstance(a, Forward)]
        assert len(forwards) == microbatches * virtual
        kinds = {a.kind for a in program if isinstance(a, Backward)}
        assert kinds == ({"input", "weight"} if name == "zb_h1" else {"full"})
        chunks_receiving_activations = {a.chunk for a in program if isinstance(a, RecvActivation)}
        chunks_sending_activations = {a.chunk for a in program if isinstance(a, SendActivation)}
        chunks_sending_grads = {a.chunk for a in program if isinstance(a, SendGrad)}
        chunks_receiving_grads = {a.chunk for a in program if isinstance(a, RecvGrad)}
        all_chunks = set(range(virtual))
        # The first global stage (rank 0, chunk 0) reads data and the last (last rank, last
        # chunk) computes the loss: neither talks to a stage beyond the ends of the pipeline.
        first = {0} if rank == 0 else set()
        last = {virtual - 1} if rank == stages - 1 else set()
        assert chunks_receiving_activations == all_chunks - first
        assert chunks_sending_grads == all_chunks - first
        assert chunks_sending_activations == all_chunks - last
        assert chunks_receiving_grads == all_chunks - last


def test_interleaved_chunks_follow_megatron_placement() -> None:
    programs = build_programs(
        "interleaved_1f1b", num_microbatches=4, num_stages=2, virtual_stages=2
    )
    # Rank 1's chunk 0 is global stage 1; its output goes to global stage 2 = rank 0, chunk 1.
    assert SendActivation(microbatch=0, chunk=0, peer_stage=0) in programs[1]
    assert RecvActivation(microbatch=0, chunk=1, peer_stage=1) in programs[0]
    # Depth first: rank 0 runs micro-batches 0 and 1 through chunk 0 before chunk 1.
    computes = [a for a in programs[0] if isinstance(a, Forward)]
    assert computes[:4] == [
        Forward(microbatch=0),
        Forward(microbatch=1),
        Forward(microbatch=0, chunk=1),
        Forward(microbatch=1, chunk=1),
    ]


def _peak_in_flight(program: list[Action], freed_by: str) -> int:
    """Most micro-batches forwarded whose backward of kind `freed_by` has not run yet."""
    alive = peak = 0
    for action in program:
        alive += isinstance(action, Forward)
        alive -= isinstance(action, Backward) and action.kind == freed_by
        peak = max(peak, alive)
    return peak


@pytest.mark.parametrize(("stages", "microbatches"), [(4, 4), (4, 12), (8, 16)])
def test_1f1b_and_zb_h1_bound_activation_memory_like_1f1b(stages: int, microbatches: int) -> None:
    one_f_one_b = build_programs("1f1b", num_microbatches=microbatches, num_stages=stages)
    zero_bubble = build_programs("zb_h1", num_microbatches=microbatches, num_stages=stages)
    for rank in range(stages):
        assert _peak_in_flight(one_f_one_b[rank], freed_by="full") == stages - rank
        # ZB-H1 frees most activations at the input gradient like 1F1B does at the backward;
        # the deferred weight gradients keep at most `stages` micro-batches' inputs on any rank,
        # the 1F1B peak of rank 0.
        assert _peak_in_flight(zero_bubble[rank], freed_by="input") == stages - rank
        assert _peak_in_flight(zero_bubble[rank], freed_by="weight") == stages


@pytest.mark.parametrize(
    ("name", "stages", "microbatches", "virtual", "message"),
    [
        ("1f1b", 4, 3, 1, "at least as many micro-batches as stages"),
        ("zb_h1", 8, 7, 1, "at least as many micro-batches as stages"),
        ("interleaved_1f1b", 4, 6, 2, "microbatches % pp == 0"),
        ("interleaved_1f1b", 4, 2, 2, "microbatches % pp == 0"),
        ("interleaved_1f1b", 4, 8, 1, "virtual_stages >= 2"),
        ("gpipe", 4, 8, 2, "does not support virtual stages"),
        ("zb_h1", 4, 8, 2, "does not support virtual stages"),
    ],
)
def test_requests_a_schedule_cannot_run_are_rejected(
    name: str, stages: int, microbatches: int, virtual: int, message: str
) -> None:
    with pytest.raises(ScheduleError, match=message.replace("%", "%").replace("(", r"\(")):
        build_programs(
            name, num_microbatches=microbatches, num_stages=stages, virtual_stages=virtual
        )


def test_plugin_registers_and_answers_through_the_plugin_manager() -> None:
    plugins = Plugins.create(autoload=False, builtins=(), extra=[("pipeline", pipeline_plugin)])
    records = {name: record for name, (_, record) in plugins.schedules().items()}
    assert set(records) == set(SCHEDULES)
    assert all(record.pipelined for record in records.values())
    assert [n for n, r in records.items() if r.supports_virtual_stages] == ["interleaved_1f1b"]
    request = ScheduleRequest(
        name="interleaved_1f1b", num_microbatches=8, stage=3, num_stages=4, virtual_stages=2
    )
    expected = build_programs(
        "interleaved_1f1b", num_microbatches=8, num_stages=4, virtual_stages=2
    )[3]
    assert plugins.schedule(request) == expected


# -- the checker on hand-written programs -------------------------------------------------------


def _two_stage_gpipe() -> dict[int, list[Action]]:
    """A correct two-stage, one-micro-batch program that the tests below break one way each."""
    return {
        0: [
            Forward(microbatch=0),
            SendActivation(microbatch=0, peer_stage=1),
            RecvGrad(microbatch=0, peer_stage=1),
            Backward(microbatch=0),
            SyncGradients(),
            OptimizerStep(),
        ],
        1: [
            RecvActivation(microbatch=0, peer_stage=0),
            Forward(microbatch=0),
            Backward(microbatch=0),
            SendGrad(microbatch=0, peer_stage=0),
            SyncGradients(),
            OptimizerStep(),
        ],
    }


def _check_two_stages(programs: dict[int, list[Action]], microbatches: int = 1) -> None:
    check_schedule(programs, num_microbatches=microbatches, num_stages=2)


def test_checker_accepts_the_reference_program() -> None:
    _check_two_stages(_two_stage_gpipe())


def test_checker_rejects_backward_before_forward() -> None:
    programs = _two_stage_gpipe()
    programs[1] = [programs[1][0], programs[1][2], programs[1][1], *programs[1][3:]]
    with pytest.raises(ScheduleError, match=r"rank 1, action 1 \(B0.*backward before the forward"):
        _check_two_stages(programs)


def test_checker_rejects_backward_without_its_gradient() -> None:
    programs = _two_stage_gpipe()
    del programs[0][2]  # rank 0 never receives G0
    del programs[1][3]  # and rank 1 never sends it
    with pytest.raises(ScheduleError, match=r"rank 0, action 2 \(B0.*before receiving gradient G0"):
        _check_two_stages(programs)


def test_checker_rejects_an_unmatched_send() -> None:
    programs = _two_stage_gpipe()
    # Rank 0 runs and sends micro-batch 1 but rank 1 never receives it.
    programs[0][2:2] = [Forward(microbatch=1), SendActivation(microbatch=1, peer_stage=1)]
    programs[0][-2:-2] = [RecvGrad(microbatch=1, peer_stage=1), Backward(microbatch=1)]
    programs[1][-2:-2] = [Forward(microbatch=1), Backward(microbatch=1)]
    with pytest.raises(
        ScheduleError,
        match=r"unmatched send: rank 0, action 3 sends A1 \(stage 0->1\) to rank 1, which never",
    ):
        _check_two_stages(programs, microbatches=2)


def test_checker_rejects_an_unmatched_or_duplicated_receive() -> None:
    programs = _two_stage_gpipe()
    del programs[1][3]  # rank 1 computes the gradient but forgets to send it
    with pytest.raises(ScheduleError, match=r"unmatched receive: rank 0, action 2 receives G0"):
        _check_two_stages(programs)
    programs = _two_stage_gpipe()
    programs[1].insert(3, SendGrad(microbatch=0, peer_stage=0))
    with pytest.raises(ScheduleError, match=r"rank 1, action 4: sends G0 .* twice"):
        _check_two_stages(programs)


def test_checker_reports_a_deadlock_cycle_with_the_stuck_ranks() -> None:
    programs = _two_stage_gpipe()
    # Rank 0 waits for the gradient before sending the activation rank 1 needs to produce it.
    programs[0] = [programs[0][0], programs[0][2], programs[0][1], *programs[0][3:]]
    with pytest.raises(ScheduleError, match="deadlock") as excinfo:
        _check_two_stages(programs)
    text = str(excinfo.value)
    assert "rank 0 waits at action 1 (recvG0" in text
    assert "rank 1 waits at action 0 (recvA0" in text


def test_checker_rejects_channels_used_in_different_orders() -> None:
    programs = build_programs("1f1b", num_microbatches=4, num_stages=2)
    # Rank 1 receives micro-batch 1 before micro-batch 0 while rank 0 sends them the other way
    # round: with messages matched in posting order, F0 would run on micro-batch 1's data.
    second_receive = programs[1].index(RecvActivation(microbatch=1, peer_stage=0))
    programs[1].insert(0, programs[1].pop(second_receive))
    with pytest.raises(ScheduleError, match="matched in posting order"):
        check_schedule(programs, num_microbatches=4, num_stages=2)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda p: p[1].__setitem__(0, RecvActivation(microbatch=0, peer_stage=1)), "peer_stage"),
        (lambda p: p[0].insert(0, RecvActivation(microbatch=0, peer_stage=1)), "first stage"),
        (lambda p: p[1].append(SyncGradients()), "exactly one SyncGradients"),
        (lambda p: p[0].insert(-2, Forward(microbatch=0)), "forwarded twice"),
        (lambda p: p[0].append(Backward(microbatch=0)), "compute after SyncGradients"),
        (lambda p: p[1].__setitem__(1, Forward(microbatch=3)), "micro-batch outside"),
    ],
)
def test_checker_rejects_malformed_actions(mutate, message: str) -> None:
    programs = _two_stage_gpipe()
    mutate(programs)
    with pytest.raises(ScheduleError, match=message):
        _check_two_stages(programs)


def test_checker_rejects_weight_gradient_before_input_gradient() -> None:
    programs = build_programs("zb_h1", num_microbatches=2, num_stages=2)
    weight = programs[1].index(Backward(microbatch=0, kind="weight"))
    programs[1].pop(weight)
    programs[1].insert(
        programs[1].index(Backward(microbatch=0, kind="input")),
        Backward(microbatch=0, kind="weight"),
    )
    with pytest.raises(ScheduleError, match="weight gradient before the input gradient"):
        check_schedule(programs, num_microbatches=2, num_stages=2)


# -- timelines and bubbles ------------------------------------------------------------------------


def _simulated_bubble(name: str, stages: int, microbatches: int, virtual: int = 1) -> float:
    programs = build_programs(
        name, num_microbatches=microbatches, num_stages=stages, virtual_stages=virtual
    )
    return simulate_timeline(programs, num_stages=stages, virtual_stages=virtual).bubble_fraction


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16)])
def test_gpipe_and_1f1b_bubble_matches_the_closed_form(
    name: str, stages: int, microbatches: int
) -> None:
    expected = (stages - 1) / (microbatches + stages - 1)
    assert _simulated_bubble(name, stages, microbatches) == pytest.approx(expected)
    theory, _ = theoretical_bubble_fraction(name, num_stages=stages, num_microbatches=microbatches)
    assert theory == pytest.approx(expected)


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_interleaved_and_zero_bubble_shrink_the_1f1b_bubble(stages: int, microbatches: int) -> None:
    one_f_one_b = _simulated_bubble("1f1b", stages, microbatches)
    interleaved = _simulated_bubble("interleaved_1f1b", stages, microbatches, virtual=2)
    zero_bubble = _simulated_bubble("zb_h1", stages, microbatches)
    assert interleaved < one_f_one_b
    assert zero_bubble < one_f_one_b
    assert interleaved == pytest.approx((stages - 1) / (2 * microbatches + stages - 1))
    # ZB-H1 with F = I = W: bubble (p-1)·1 against 3m of work per rank.
    assert zero_bubble == pytest.approx((stages - 1) / (3 * microbatches + stages - 1))


def test_timeline_times_follow_dependencies_and_latency() -> None:
    programs = build_programs("1f1b", num_microbatches=4, num_stages=2)
    timeline = simulate_timeline(programs, num_stages=2)
    starts = {(r, t.action): t.start for r, row in timeline.rows.items() for t in row}
    assert starts[(1, Forward(microbatch=0))] == 1.0  # after rank 0's F0
    assert starts[(0, Backward(microbatch=0))] == 4.0  # after rank 1's F0 then B0
    assert timeline.makespan == 15.0  # (m + p - 1) · (F + B)
    slow = simulate_timeline(programs, num_stages=2, costs=ActionCosts(p2p_latency=0.5))
    assert slow.makespan > timeline.makespan
    assert slow.bubble_fraction > timeline.bubble_fraction


def test_timeline_replays_stages_of_unequal_cost() -> None:
    # 1F1B, p = 2, m = 4, the last stage twice as slow: it is busy from the first forward's
    # hand-over to its last backward, then the first stage runs its last backward.
    programs = build_programs("1f1b", num_microbatches=4, num_stages=2)
    costs = {0: ActionCosts(forward=1.0, backward=2.0), 1: ActionCosts(forward=2.0, backward=4.0)}
    timeline = simulate_timeline(programs, num_stages=2, costs=costs)
    assert timeline.makespan == 1.0 + 4 * (2.0 + 4.0) + 2.0
    assert timeline.bubble_fraction == pytest.approx(1 - (4 * 3 + 4 * 6) / (2 * 27))
    equal = simulate_timeline(programs, num_stages=2, costs=ActionCosts(forward=1.0, backward=2.0))
    assert equal.bubble_fraction == pytest.approx(1 / 5)  # (p-1)/(m+p-1)
    with pytest.raises(ScheduleError, match=r"no action costs for ranks \[1\]"):
        simulate_timeline(programs, num_stages=2, costs={0: ActionCosts()})


def test_timeline_renders_as_text_and_png(tmp_path) -> None:
    programs = build_programs("zb_h1", num_microbatches=4, num_stages=2)
    timeline = simulate_timeline(programs, num_stages=2)
    text = render_text(timeline)
    rows = text.splitlines()
    cells = [" ".join(row.split("|")[1].split()) for row in rows[1:]]
    assert cells == [
        "F0 F1 . I0 W0 F2 I1 W1 F3 I2 W2 I3 W3",
        ". F0 I0 F1 I1 W0 F2 I2 W1 F3 I3 W2 W3",
    ]
    path = tmp_path / "timeline.png"
    render_png(timeline, path, title="zb_h1")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# -- plait schedule show --------------------------------------------------------------------------


def _show(arguments: str):
    return CliRunner().invoke(app, ["show", *arguments.split()])


def test_cli_show_prints_timeline_and_bubbles_and_writes_png(tmp_path) -> None:
    png = tmp_path / "pp.png"
    result = _show(f"--pp 4 --microbatches 8 --schedule 1f1b --png {png}")
    assert result.exit_code == 0, result.output
    assert "rank 3 | .  .  .  F0 B0 B0 F1" in result.output
    assert "bubble fraction: simulated 0.2727, theoretical 0.2727 = (p-1)/(m+p-1)" in result.output
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = _show("--pp 4 --microbatches 8 --schedule interleaved_1f1b --virtual 2")
    assert result.exit_code == 0, result.output
    assert "F0.1" in result.output
    assert "simulated 0.1579, theoretical 0.1579" in result.output


def test_cli_show_reports_what_a_schedule_needs() -> None:
    result = _show("--pp 4 --microbatches 6 --schedule interleaved_1f1b --virtual 2")
    assert result.exit_code == 2
    assert "microbatches % pp == 0" in result.output
