"""`fault_tolerance.keep_global_batch`: a step without some groups still trains on the whole batch.

Three replica groups of one rank each train under a hosted lighthouse; group C dies (SIGKILL)
inside step 2, which A and B roll back and retry without it. With the flag on, A takes C's share
from then on (A trains on two shares, B on one, weighed 2 : 1) and the run equals one process
training on the whole global batch every step; with it off, the run equals one process training
on the live groups' shares only, which is not the same run. The flag-on case reads documents one
per padded row, so the shares score different numbers of tokens and the groups must be weighed by
tokens (the flag-off case averages groups equally, as torchft does, so it reads the token stream,
where every row scores alike).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.testing.distributed import RankFailure, run_distributed
from plait.daemon.lighthouse import HostedLighthouse, LighthouseSettings
from tests.dist import fault_tolerance_batch_workers as workers

pytestmark = pytest.mark.dist

TIMEOUT = 90.0
# One process accumulates micro-batches where the groups add their gradients: fp32 rounding.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


class Group(threading.Thread):
    """One replica group's rank, run in the background; `result` or `error` when done."""

    def __init__(self, group: int, lighthouse: str, markers: Path, keep: bool, corpus: str) -> None:
        super().__init__(daemon=True)
        self.args = (group, lighthouse, str(markers), keep, corpus)
        self.result: dict[str, Any] | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = run_distributed(
                workers.replica_group_rank, 1, *self.args, timeout=TIMEOUT
            )[0]
        except BaseException as exc:  # reported by the test
            self.error = exc


def _run(tmp_path: Path, *, keep: bool, corpus: str) -> list[dict[str, Any]]:
    lighthouse = HostedLighthouse(
        LighthouseSettings(
            bind="127.0.0.1:0", join_timeout_seconds=30.0, heartbeat_timeout_seconds=1.0
        )
    )
    try:
        groups = [
            Group(g, lighthouse.address, tmp_path, keep, corpus) for g in range(workers.GROUPS)
        ]
        for group in groups:
            group.start()
        for group in groups:
            group.join(TIMEOUT)
    finally:
        lighthouse.stop()
    *survivors, dead = groups
    for index, group in enumerate(survivors):
        assert group.error is None, f"group {index}: {group.error}"
    assert isinstance(dead.error, RankFailure) and "code -9" in str(dead.error), dead.error
    return [group.result for group in survivors if group.result is not None]


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[name] - b[name]).abs().max()) for name in a)


@pytest.mark.parametrize("keep", [True, False], ids=["keep", "shrink"])
def test_keep_global_batch_trains_every_step_on_the_whole_batch(tmp_path: Path, keep: bool) -> None:
    corpus = workers.write_padded_corpus(tmp_path / "corpus") if keep else ""
    survivors = _run(tmp_path, keep=keep, corpus=corpus)
    death = workers.DEATH_STEP
    for group, result in enumerate(survivors):
        tries = result["tries"]
        # The step C died in was tried with it, not committed, and retried without it.
        assert [t["step"] for t in tries] == [*range(death + 1), *range(death, workers.STEPS)]
        assert [t["committed"] for t in tries].count(False) == 1
        assert not tries[death]["committed"] and tries[death]["participants"] == workers.GROUPS
        committed = [t for t in tries if t["committed"]]
        assert [t["participants"] for t in committed] == [
            len(workers.groups_of(s)) for s in range(workers.STEPS)
        ]
        # One data position for every group's rows: once per committed step, back on a failure.
        assert result["data_step"] == workers.STEPS
        if keep:
            taken = (group, 2) if group == 0 else (group,)
            assert [t["shares"] for t in tries] == [(group,)] * (death + 1) + [taken] * (
                workers.STEPS - death
            )
        else:
            assert all(t["shares"] == () for t in tries)
        # A survivor runs a forward per share it read, each of one share's rows (memory bound).
        assert [t["forwards"] for t in tries] == [max(1, len(t["shares"])) for t in tries]
    a, b = (result["weights"] for result in survivors)
    for name, value in a.items():
        torch.testing.assert_close(value, b[name], **TOLERANCE, msg=f"{name}: A != B")
    replays = run_distributed(workers.replays, 1, corpus, timeout=TIMEOUT)[0]
    expected, other = (
        (replays["full"], replays["shrunk"]) if keep else (replays["shrunk"], replays["full"])
    )
    for name, value in a.items():
        torch.testing.assert_close(value, expected[name], **TOLERANCE, msg=f"{name}")
    # The flag changes the run: the other replay is far outside the tolerance.
    assert _max_difference(a, other) > 1e-3
