"""A replica group torchrun restarted never starts the run over: alone at step 0 (no live peer
healed it, no checkpoint was resumed) its first step refuses, before any training."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from plait.core.errors import PlaitError
from plait.plugins.fault_tolerance.steps import FaultTolerantSteps, NoStateToResume


class QuorumOf:
    """Stands in for torchft's manager: a quorum of `participants` groups, nothing else."""

    def __init__(self, participants: int) -> None:
        self.participants = participants
        self._quorum_id = 1

    def start_quorum(self) -> None:
        pass

    def num_participants(self) -> int:
        return self.participants

    def load_state_dict(self, state: dict[str, int]) -> None:
        del state


class Trained(Exception):
    """Raised by the stand-in engine's step: the group went on to train."""


def _engine(global_step: int) -> Any:
    param = torch.nn.Parameter(torch.zeros(1))

    def train_step(*_: Any, **__: Any) -> float:
        raise Trained

    runtimes: list[Any] = []
    return SimpleNamespace(
        global_step=global_step,
        runtimes=runtimes,
        append_runtime=runtimes.append,
        optimizer=torch.optim.SGD([param], lr=0.1),
        lr_scheduler=None,
        train_step=train_step,
    )


def _batches() -> Any:
    return SimpleNamespace(state_dict=lambda: {"step": 0}, next_batch=lambda: None)


def _steps(*, restarted: bool, participants: int, global_step: int) -> FaultTolerantSteps:
    return FaultTolerantSteps(
        engine=_engine(global_step),
        batches=_batches(),
        manager=QuorumOf(participants),
        store=None,
        restarted=restarted,
    )


def test_a_restarted_group_alone_at_step_zero_refuses_to_train() -> None:
    with pytest.raises(NoStateToResume, match=r"checkpoint_io\.dir"):
        _steps(restarted=True, participants=1, global_step=0).step()


@pytest.mark.parametrize(
    ("restarted", "participants", "global_step"),
    [
        (False, 1, 0),  # a fresh job's first group
        (True, 2, 0),  # a peer at step 0 too: nothing was lost
        (True, 1, 7),  # resumed from a checkpoint (or healed) to step 7
    ],
)
def test_otherwise_it_trains(restarted: bool, participants: int, global_step: int) -> None:
    with pytest.raises(Trained):
        _steps(restarted=restarted, participants=participants, global_step=global_step).step()


def _steps_of_job(
    *, participants: int, global_step: int, reached: int | None, manager: Any = None
) -> FaultTolerantSteps:
    from plait.plugins.fault_tolerance.job_progress import JobProgress

    return FaultTolerantSteps(
        engine=_engine(global_step),
        batches=_batches(),
        manager=manager or QuorumOf(participants),
        store=None,
        job_reached=(
            None
            if reached is None
            else JobProgress(job_id="my-run", step=reached, replica_id="my-run-group0:9c1e")
        ),
    )


def test_a_new_group_alone_at_step_zero_of_a_job_that_trained_refuses() -> None:
    # Not restarted by torchrun: a replacement started by hand, its run directory fresh.
    with pytest.raises(NoStateToResume, match=r"job 'my-run' had trained 31 steps.*my-run-group0"):
        _steps_of_job(participants=1, global_step=0, reached=31).step()


@pytest.mark.parametrize(
    ("participants", "global_step", "reached"),
    [
        (2, 0, 31),  # a live peer heals it in this quorum
        (1, 31, 31),  # resumed from the job's checkpoint
        (1, 0, 0),  # the job's groups had not trained yet
        (1, 0, None),  # the lighthouse's last quorum had none of the job's groups
    ],
)
def test_a_new_group_trains_when_nothing_is_lost(
    participants: int, global_step: int, reached: int | None
) -> None:
    with pytest.raises(Trained):
        _steps_of_job(participants=participants, global_step=global_step, reached=reached).step()


class SlowQuorum(QuorumOf):
    """The first quorum times out, as torchft's client does when the lighthouse waits for a
    group that heartbeats but never asks; the next one forms."""

    def __init__(self) -> None:
        super().__init__(participants=1)
        self.asked = 0
        self._quorum_future: object | None = None

    def start_quorum(self) -> None:
        self.asked += 1
        if self.asked == 1:
            self._quorum_future = "failed"  # torchft would re-raise it at the next start
            raise TimeoutError('status: Cancelled, message: "Timeout expired"')
        assert self._quorum_future is None, "the failed quorum was not cleared"


def test_a_quorum_that_times_out_is_asked_again_while_the_lighthouse_answers() -> None:
    from plait.daemon.lighthouse import HostedLighthouse, LighthouseSettings

    lighthouse = HostedLighthouse(LighthouseSettings(bind="127.0.0.1:0"))
    try:
        manager = SlowQuorum()
        steps = _steps_of_job(participants=1, global_step=3, reached=None, manager=manager)
        steps.lighthouse = lighthouse.address
        with pytest.raises(Trained):
            steps.step()
        assert manager.asked == 2
    finally:
        lighthouse.stop()


def test_a_quorum_that_times_out_with_the_lighthouse_gone_ends_the_group() -> None:
    from tests.free_ports import refused_port

    with refused_port() as port:
        steps = _steps_of_job(participants=1, global_step=3, reached=None, manager=SlowQuorum())
        steps.lighthouse, steps.quorum_timeout = f"127.0.0.1:{port}", 60.0
        with pytest.raises(PlaitError, match=r"no quorum within 60 s.*does not answer"):
            steps.step()
