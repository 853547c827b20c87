"""Ranks started by `run_distributed` see the caller's environment and working directory as they
are at the call, even though they fork from a server started earlier (`_rank_context`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from plait.testing.distributed import run_distributed

SET, GONE = "PLAIT_TEST_RANK_SET", "PLAIT_TEST_RANK_GONE"


def _seen(rank: int, world_size: int) -> tuple[str | None, str | None, str, str]:
    return os.environ.get(SET), os.environ.get(GONE), os.environ["WORLD_SIZE"], os.getcwd()


def test_ranks_see_the_environment_and_directory_of_the_call(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(GONE, "present")
    monkeypatch.delenv(SET, raising=False)
    # The fork server runs from here on, with GONE set and SET unset.
    assert run_distributed(_seen, 1) == [(None, "present", "1", os.getcwd())]
    monkeypatch.setenv(SET, "yes")
    monkeypatch.delenv(GONE)
    monkeypatch.chdir(tmp_path)
    assert run_distributed(_seen, 2) == [("yes", None, "2", str(tmp_path))] * 2
