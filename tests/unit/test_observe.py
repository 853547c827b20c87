"""`plait.observe` in one process: bad arguments, identity from the launcher's variables, tokens
from inputs, the GPU timing path on a stand-in device, and no cost without a daemon."""

from __future__ import annotations

import socket

import pytest
import torch

import plait
from plait.core.errors import PlaitError
from plait.core.phase_timing import DEVICE_TIMING
from plait.plugins.telemetry import observe_identity
from plait.plugins.telemetry.observe import count_tokens
from plait.plugins.telemetry.observe_identity import launch_identity
from plait.plugins.telemetry.observe_timeline import StepClock, StepTimeline
from tests.daemon.fake_cuda import FakeCuda, FakeDevice


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(32, 8), torch.nn.Linear(8, 32))


def _nowhere() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.parametrize(
    ("kwargs", "names"),
    [
        ({"model": "not a module"}, "model must be a torch.nn.Module"),
        ({"optimizer": object()}, "optimizer must be a torch.optim.Optimizer"),
        ({"daemon": "nowhere"}, "daemon must be 'host:port'"),
        ({"flops_per_token": -1.0}, "flops_per_token must be finite and > 0"),
        ({"flops_per_token": float("nan")}, "flops_per_token must be finite and > 0"),
        ({"flops_per_token": "6e9"}, "flops_per_token must be a number"),
        ({"job_id": "  "}, "job_id must be a non-empty string"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs: dict, names: str) -> None:
    model = kwargs.pop("model", _model())
    with pytest.raises(PlaitError, match=names):
        plait.observe(model, **kwargs)


def test_identity_from_torchrun_then_slurm_then_one_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A process group another test left initialised in this process would answer first.
    monkeypatch.setattr(observe_identity.dist, "is_initialized", lambda: False)
    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "TORCHELASTIC_RUN_ID": "r7",
                "SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_JOB_ID": "991"}  # fmt: skip
    who = launch_identity(env=torchrun)
    assert (who.rank, who.world_size, who.local_rank, who.job_id) == (3, 8, 1, "r7")
    slurm = {"SLURM_PROCID": "5", "SLURM_NTASKS": "16", "SLURM_LOCALID": "2",
             "SLURM_JOB_ID": "991", "TORCHELASTIC_RUN_ID": "none"}  # fmt: skip
    who = launch_identity(env=slurm)
    assert (who.rank, who.world_size, who.local_rank, who.job_id) == (5, 16, 2, "991")
    assert launch_identity(env={"PLAIT_JOB_ID": "mine", **slurm}).job_id == "mine"
    assert launch_identity("given", env={"PLAIT_JOB_ID": "mine"}).job_id == "given"
    alone = launch_identity(env={})
    assert (alone.rank, alone.world_size, alone.job_id) == (0, 1, "local")
    with pytest.raises(PlaitError, match=r"\$RANK must be an integer"):
        launch_identity(env={"RANK": "zero"})


def test_tokens_are_the_integer_inputs() -> None:
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert count_tokens((ids,), {}) == 64
    assert count_tokens((), {"input_ids": ids, "labels": ids}) == 64
    assert count_tokens((torch.zeros(4, 3, 32, 32),), {}) == 0  # pixels are not tokens


def test_a_step_timed_on_the_device_uses_device_times() -> None:
    """The GPU path on a stand-in device that runs 5 ms behind the host: phases carry device
    intervals, and the step's bounds are read from its events once the device passed them."""
    device = FakeDevice()
    cuda = FakeCuda(device)
    cuda.synchronize = device.run  # type: ignore[attr-defined]

    class Stream:
        def query(self) -> bool:
            return device.done_ms >= device.queued_ms

    cuda.current_stream = Stream  # type: ignore[attr-defined]
    clock = StepClock(cuda)
    clock.anchor_if_idle()
    timeline = StepTimeline(0, clock, clock.mark(), anchor=clock.anchor)
    device.launch(2.0)  # the batch's copy
    timeline.forward_started()
    device.launch(10.0)
    timeline.forward_finished()
    timeline.backward_started()
    device.launch(20.0)
    timeline.backward_finished()
    timeline.optimizer_started()
    device.launch(3.0)
    timeline.optimizer_finished()
    timeline.finish()
    assert not timeline.ready()  # the device has not passed the step's end: nothing is read
    device.run()
    assert timeline.ready()
    start, data_end, end = timeline.bounds_ns()
    assert (end - start) / 1e6 == pytest.approx(35.0, abs=0.01)  # the device's 2+10+20+3 ms
    assert (data_end - start) / 1e6 == pytest.approx(2.0, abs=0.01)
    names = [phase.name for phase in timeline.phases]
    assert names == ["data", "forward", "backward", "optimizer"]
    intervals = [phase.attributes[DEVICE_TIMING] for phase in timeline.phases]
    lengths = [(b - a) / 1e6 for a, b in (interval.times() for interval in intervals)]
    assert lengths == pytest.approx([2.0, 10.0, 20.0, 3.0], abs=0.01)


def test_without_a_daemon_the_observer_removes_its_hooks(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    observer = plait.observe(model, optimizer=optimizer, daemon=_nowhere())
    assert model._forward_pre_hooks and model._forward_hooks
    ids = torch.randint(0, 32, (2, 5))
    for _ in range(3):
        with observer.step() as step:
            model(ids).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    assert step.number == 2 and observer.state == "off"
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert "no daemon reachable" in caplog.text
    observer.close()


def test_steps_do_not_nest_and_must_be_open_to_end() -> None:
    observer = plait.observe(_model(), daemon=_nowhere())
    with pytest.raises(PlaitError, match="steps do not nest"), observer.step(), observer.step():
        pass
    with pytest.raises(PlaitError, match="no step is open"):
        observer.end_step()
    with pytest.raises(PlaitError, match="tokens must be an int"):
        observer.begin_step(tokens=-3)
    observer.close()
