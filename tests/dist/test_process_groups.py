"""The process groups plait creates are destroyed at exit, and their Gloo worker threads end;
a group the caller created is left alone (`plait.core.process_groups`)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.core import process_groups
from plait.core.errors import PlaitError
from plait.core.mesh import Mesh
from plait.testing.distributed import run_distributed

pytestmark = pytest.mark.dist


def plait_created_groups_end_at_teardown(rank: int, world_size: int) -> dict[str, Any]:
    del rank, world_size
    dist.destroy_process_group()  # the harness's group: plait creates its own below
    mesh = Mesh.from_env(device="cpu")  # one process, no torchrun: plait's one-rank group
    group = mesh.group("dp")
    dist.all_reduce(torch.ones(4), group=group.process_group)
    owned, before = process_groups.owns_process_group(), process_groups.gloo_worker_threads()
    process_groups.teardown()  # what the atexit handler runs
    try:
        error = f"still usable: {group.process_group}"
    except PlaitError as exc:
        error = str(exc)
    return {
        "owned": owned,
        "workers_before": before,
        "workers_after": process_groups.gloo_worker_threads(),
        "initialized_after": dist.is_initialized(),
        "error": error,
    }


def callers_group_is_left_alone(rank: int, world_size: int) -> dict[str, Any]:
    del world_size
    mesh = Mesh.from_env(device="cpu")  # the harness initialised the default group
    dist.all_reduce(torch.ones(4), group=mesh.group("dp").process_group)
    owned = process_groups.owns_process_group()
    process_groups.teardown()
    # The caller's group still works after plait's teardown.
    tensor = torch.full((2,), float(rank))
    dist.all_reduce(tensor)
    return {
        "owned": owned,
        "initialized_after": dist.is_initialized(),
        "workers_after": process_groups.gloo_worker_threads(),
        "sum": tensor.tolist(),
    }


def test_plait_destroys_its_groups_and_their_worker_threads_end() -> None:
    (result,) = run_distributed(plait_created_groups_end_at_teardown, 1, timeout=120)
    assert result["owned"] and result["workers_before"] > 0
    assert result["workers_after"] == 0 and not result["initialized_after"]
    assert "process group 'dp' [0] was destroyed" in result["error"]


def test_a_group_the_caller_created_is_left_alone() -> None:
    for result in run_distributed(callers_group_is_left_alone, 2, timeout=120):
        assert not result["owned"] and result["initialized_after"]
        assert result["workers_after"] > 0 and result["sum"] == [1.0, 1.0]
