"""A replica group torchrun restarted never starts the run over: alone at step 0 (no live peer
healed it, no checkpoint was resumed) its first step refuses, before any training."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

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

    return SimpleNamespace(
        global_step=global_step,
        runtimes=[],
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
