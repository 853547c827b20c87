"""How a replica group's step averages across the quorum when a peer dies while the layouts are
judged: every rank of the group takes the same path, and none averages on garbage.

The judgement sums each group's layout fingerprint over the quorum. When that all-reduce fails
on some rank (a peer group died), its sums are garbage: before, that rank could conclude the
layouts differ and enter the canonical split's collectives alone while its group-mates went on
to the commit vote, each waiting for the other until a timeout ended the survivor."""

from __future__ import annotations

from typing import Any

import torch

from plait.plugins.fault_tolerance.commit import ReplicaGroupCommit


class _Done:
    def wait(self) -> None:
        return None


class FakeManager:
    """torchft's `Manager` as the commit runtime uses it: an all-reduce over `participants`
    groups of one fingerprint (or a failure), `errored`, the quorum id."""

    def __init__(self, *, participants: int = 2, fails: bool = False) -> None:
        self._quorum_id = 7
        self.participants = participants
        self.fails = fails
        self.reduced: list[torch.Tensor] = []

    def allreduce(self, tensor: torch.Tensor, reduce_op: Any = None) -> _Done:
        self.reduced.append(tensor)
        if self.fails:
            tensor.fill_(12345.0)  # what a broken all-reduce leaves: anything
        else:
            tensor.mul_(self.participants)  # every group sent the same
        return _Done()

    def errored(self) -> Exception | None:
        return RuntimeError("[/gloo/pair.cc:553] Connection closed by peer") if self.fails else None

    def num_participants(self) -> int:
        return self.participants


class FakeSplit:
    fingerprint = (3, 5)

    def __init__(self) -> None:
        self.averaged = 0

    def average(self, all_reduce_mean: Any) -> None:
        self.averaged += 1


def _commit(
    manager: FakeManager, group_verdict: tuple[float, float] | None
) -> tuple[ReplicaGroupCommit, FakeSplit]:
    parameter = torch.nn.Parameter(torch.ones(4))
    parameter.grad = torch.full((4,), 2.0)
    split = FakeSplit()

    def group_max(tensor: torch.Tensor) -> None:
        if group_verdict is not None:  # what another rank of the group saw, max-reduced in
            tensor.copy_(torch.maximum(tensor, torch.tensor(group_verdict)))

    commit = ReplicaGroupCommit(
        manager=manager,
        optimizer=torch.optim.SGD([parameter], lr=0.1),
        split_factory=lambda: split,  # type: ignore[return-value,arg-type]
        group_max=group_max,
    )
    return commit, split


def test_a_failed_judgement_averages_nothing_and_is_judged_again() -> None:
    manager = FakeManager(fails=True)
    commit, split = _commit(manager, group_verdict=None)
    commit.sync_gradients()
    # Only the fingerprint sums went out: no gradient all-reduce, no split on garbage sums.
    assert len(manager.reduced) == 1 and split.averaged == 0
    manager.fails = False
    commit.sync_gradients()  # the retry's quorum is judged anew
    assert len(manager.reduced) == 3 and split.averaged == 0


def test_a_group_mates_failure_stops_this_rank_too() -> None:
    manager = FakeManager()
    commit, split = _commit(manager, group_verdict=(1.0, 0.0))
    commit.sync_gradients()
    assert len(manager.reduced) == 1 and split.averaged == 0


def test_the_groups_verdict_that_layouts_differ_is_every_ranks() -> None:
    manager = FakeManager()
    commit, split = _commit(manager, group_verdict=(0.0, 1.0))
    commit.sync_gradients()
    assert split.averaged == 1 and len(manager.reduced) == 1


def test_same_layouts_average_the_gradients_as_held() -> None:
    manager = FakeManager()
    commit, split = _commit(manager, group_verdict=(0.0, 0.0))
    commit.sync_gradients()
    assert split.averaged == 0 and len(manager.reduced) == 2
