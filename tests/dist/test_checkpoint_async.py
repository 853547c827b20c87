"""Asynchronous checkpoints (the default): the same bytes as a synchronous save although
training goes on during the write, one write at a time, and a write that fails half-way (a
full disk) reported by name while training goes on and the previous checkpoint stays usable."""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import pytest

from plait.plugins.checkpoint.storage import LATEST, MANIFEST, list_checkpoints, verify
from plait.testing.distributed import run_distributed
from tests.dist import checkpoint_async_workers, checkpoint_workers

pytestmark = pytest.mark.dist


def _metadata(directory: Path) -> tuple[object, object]:
    """DCP's index without its `storage_meta` (the save's own id and path)."""
    with (directory / ".metadata").open("rb") as f:
        metadata = pickle.load(f)
    return metadata.state_dict_metadata, metadata.storage_data


@pytest.mark.timeout(240)
def test_async_save_writes_the_synchronous_bytes_while_training_goes_on(tmp_path: Path) -> None:
    results = run_distributed(
        checkpoint_async_workers.async_equals_sync, 2, str(tmp_path), timeout=200
    )
    for result in results:
        # save() returned with the write still held: the steps after it trained meanwhile.
        assert result["running_during_training"] == [True, True], result
        # The save of step 5 staged its copy only after the write of step 3 had finished.
        assert result["in_flight_at_stage"] == [0, 0], result
        assert [(step, is_async) for step, is_async, *_ in result["timings"]] == [
            (3, True),
            (5, True),
        ]
    for step in ("step-00000003", "step-00000005"):
        sync, later = tmp_path / "sync" / step, tmp_path / "async" / step
        assert verify(later).ok and verify(sync).ok
        names = sorted(p.name for p in sync.iterdir())
        assert sorted(p.name for p in later.iterdir()) == names
        for name in names:
            if name.endswith(".distcp"):
                assert (later / name).read_bytes() == (sync / name).read_bytes(), (step, name)
        assert _metadata(later) == _metadata(sync), step
    assert (tmp_path / "async" / LATEST).read_text().strip() == "step-00000005"


@pytest.mark.timeout(240)
def test_a_full_disk_mid_write_is_reported_by_name_and_training_goes_on(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    results = run_distributed(
        checkpoint_async_workers.full_disk_mid_write, 2, str(root), timeout=200
    )
    for result in results:
        # Nothing to report until the next save waits for the failed one; then it is named,
        # with the error of the rank whose disk was full, on every rank.
        assert result["reported_by_step"][2] == [] and result["reported_by_step"][4] == []
        (report,) = result["reported_by_step"][6]
        assert report.startswith("checkpoint step-00000004 was not saved"), report
        assert "rank 1: OSError" in report, report
        assert "No space left on device" in report, report
        # When it was reported, the failed write had left nothing behind; step 2 was intact.
        on_disk = [n for n in result["on_disk_by_step"][6] if n != ".tmp-step-00000006"]
        assert on_disk == [LATEST, "step-00000002"], result
        # Training went on through the failure, and the next save published.
        assert sorted(result["losses"]) == list(range(6))
        assert result["published"] == ["step-00000006", "step-00000002"]
    assert verify(root / "step-00000002").ok
    assert (root / "step-00000002" / MANIFEST).is_file()

    # The previous checkpoint resumes: a job that lost step 6 too starts again from step 2.
    shutil.rmtree(root / "step-00000006")
    train = checkpoint_workers.train_and_checkpoint
    (resumed,) = run_distributed(train, 1, str(root), 3, (), True, timeout=120)
    assert resumed["start"] == 2
    assert [p.name for p in list_checkpoints(root)] == ["step-00000002"]
