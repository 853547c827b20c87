"""Healing across inner layouts, and the job's disk checkpoint under fault tolerance.

- A replacement group running ZeRO-3 heals from a live group running ZeRO-1 (torchft's transport
  pairs equal group ranks; plait sends layout-independent chunks and the healing group
  reshards them among its ranks), then both average their gradients through the canonical
  split and train equal, bit for bit, to one process replaying the schedule.
- One group writes the job's checkpoint: the first of each step's quorum, so when group 0 dies
  group 1 takes over; a replacement started when no group is left resumes from it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.testing.distributed import RankFailure, run_distributed
from plait.daemon.lighthouse import LighthouseSettings
from plait.daemon.server import DaemonServer
from plait.plugins.checkpoint.storage import step_dir_name
from tests.dist import fault_tolerance_healing_workers as workers
from tests.dist.fault_tolerance_workers import wait_for

pytestmark = pytest.mark.dist

TIMEOUT = 120.0


class Group(threading.Thread):
    """One replica group's ranks, run in the background; `result` or `error` when done."""

    def __init__(
        self, fn: Callable[..., Any], ranks: int, *args: Any, env: dict[str, str] | None = None
    ) -> None:
        super().__init__(daemon=True)
        self.fn, self.ranks, self.args, self.env = fn, ranks, args, env
        self.result: list[Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = run_distributed(
                self.fn, self.ranks, *self.args, timeout=TIMEOUT, env=self.env
            )
        except BaseException as exc:  # reported by the test
            self.error = exc


def _lighthouse() -> DaemonServer:
    return DaemonServer(
        bind="127.0.0.1:0",
        lighthouse=LighthouseSettings(
            bind="127.0.0.1:0", join_timeout_seconds=30.0, heartbeat_timeout_seconds=2.0
        ),
    ).start()


def _assemble(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Whole parameters from every rank's held chunks (each element written by some rank)."""
    whole: dict[str, torch.Tensor] = {}
    filled: dict[str, torch.Tensor] = {}
    for result in ranks:
        for name, (shape, chunks) in result["weights"].items():
            tensor = whole.setdefault(name, torch.zeros(shape))
            mask = filled.setdefault(name, torch.zeros(shape, dtype=torch.bool))
            for offsets, values in chunks:
                index = tuple(slice(o, o + s) for o, s in zip(offsets, values.shape, strict=True))
                tensor[index] = values
                mask[index] = True
    for name, mask in filled.items():
        assert bool(mask.all()), f"{name}: the ranks' chunks do not cover it"
    return whole


def _committed(tries: list[dict[str, Any]]) -> list[int]:
    return [t["step"] for t in tries if t["committed"]]


def test_a_zero3_replacement_heals_from_a_zero1_group_and_trains_like_the_replay(
    tmp_path: Path,
) -> None:
    daemon = _lighthouse()
    assert daemon.lighthouse is not None
    address = daemon.lighthouse.address
    try:
        group_a = Group(workers.layout_group_rank, 2, "A", address, str(tmp_path), "zero1")
        group_a.start()
        wait_for(tmp_path / "A-at-join", "group A to reach the join step", unless=group_a)
        healer = Group(workers.layout_group_rank, 2, "B'", address, str(tmp_path), "zero3")
        healer.start()
        group_a.join(TIMEOUT)
        healer.join(TIMEOUT)
    finally:
        daemon.stop(grace=0.5)
    assert group_a.error is None, group_a.error
    assert healer.error is None, healer.error
    assert group_a.result is not None and healer.result is not None
    join = workers.JOIN_STEP
    for rank_a in group_a.result:
        assert _committed(rank_a["tries"]) == list(range(workers.HEAL_STEPS))
        assert [t["participants"] for t in rank_a["tries"]] == [1] * join + [2] * (
            workers.HEAL_STEPS - join
        )
    for rank_b in healer.result:
        tries = rank_b["tries"]
        # Healed from A at its first quorum: it never trained from its own start.
        assert tries[0]["step"] == join and ("heal", join, 2, 0) in tries[0]["events"]
        assert _committed(tries) == list(range(join, workers.HEAL_STEPS))
    schedule = ((0,),) * join + ((0, 1),) * (workers.HEAL_STEPS - join)
    replay = run_distributed(workers.replay, 1, 2, schedule, 8, timeout=TIMEOUT)[0]
    zero1, zero3 = _assemble(group_a.result), _assemble(healer.result)
    for name, expected in replay.items():
        assert torch.equal(zero1[name], expected), f"{name}: A (ZeRO-1) != the replay"
        # Bit for bit across layouts too: the heal copies bits, and every addition (a rank's
        # two-term reduction inside its group, the quorum's two-term sum) is the replay's.
        assert torch.equal(zero3[name], expected), f"{name}: B' (ZeRO-3) != the replay"


def test_the_first_live_group_writes_the_checkpoint_and_a_lone_replacement_resumes_from_it(
    tmp_path: Path,
) -> None:
    checkpoints = str(tmp_path / "checkpoints")
    daemon = _lighthouse()
    assert daemon.lighthouse is not None
    address = daemon.lighthouse.address
    fn = workers.checkpoint_group_rank
    try:
        group_a = Group(fn, 1, "A", address, str(tmp_path), checkpoints)
        group_b = Group(fn, 1, "B", address, str(tmp_path), checkpoints)
        group_a.start()
        group_b.start()
        wait_for(tmp_path / "A-failed", "group A to fail", unless=group_a)
        wait_for(tmp_path / "B-failed", "group B to fail", unless=group_b)
        group_a.join(TIMEOUT)
        group_b.join(TIMEOUT)
        # No group is left: torchrun restarts group 0.
        replacement = Group(
            fn,
            1,
            "A'",
            address,
            str(tmp_path),
            checkpoints,
            env={"TORCHELASTIC_RESTART_COUNT": "1"},
        )
        replacement.start()
        replacement.join(TIMEOUT)
    finally:
        daemon.stop(grace=0.5)
    for group in (group_a, group_b):
        assert isinstance(group.error, RankFailure) and "code -9" in str(group.error)
    assert replacement.error is None, replacement.error
    assert replacement.result is not None
    (rank,) = replacement.result
    a_dies, b_dies, steps = workers.A_DIES, workers.B_DIES, workers.CHECKPOINT_STEPS
    # A wrote the checkpoints while it lived (B, in the same quorums, did not); B wrote the one
    # after A died; the replacement resumed from B's, alone, and trained on from there.
    wrote = sorted(p.name for p in tmp_path.glob("wrote-*"))
    assert wrote == [f"wrote-A'-0-{steps}", f"wrote-A-0-{a_dies}", f"wrote-B-0-{b_dies}"], wrote
    saved = sorted(p.name for p in Path(checkpoints).iterdir() if p.name.startswith("step-"))
    assert saved == [step_dir_name(s) for s in (a_dies, b_dies, steps)], saved
    assert rank["start"] == b_dies
    assert rank["tries"][0]["participants"] == 1
    assert _committed(rank["tries"]) == list(range(b_dies, steps))
    assert rank["written"] == [steps]
    schedule = ((0, 1),) * a_dies + ((1,),) * (b_dies - a_dies) + ((0,),) * (steps - b_dies)
    replay = run_distributed(workers.replay, 1, 1, schedule, 4, timeout=TIMEOUT)[0]
    for name, value in rank["weights"].items():
        assert torch.equal(value, replay[name]), f"{name}: A' != the replay"
