"""ZeRO-1 with its optimizer state in files (`zero.offload.device = "nvme"`) on 2 Gloo ranks
trains as ZeRO-1 without offload does, and the files hold what the planner's memory model says
they hold (`MemoryEstimate.disk_optimizer_state`).

`"cpu"` is not run here: on CPU ranks it moves nothing (the state is in host memory already),
so a comparison would pass by construction. Stages 2 and 3 with files are checked against DDP
in test_zero.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.planner.auto import job_for_config, layout_from_config
from plait.planner.devices import DEVICES
from plait.planner.memory_model import estimate_memory
from plait.testing.distributed import run_distributed
from tests.dist import zero_workers

pytestmark = pytest.mark.dist

# The planner counts the state of N / d parameters; the runtime pads each bucket's chunk to a
# multiple of d elements.
PADDING_TOL = 0.05


def _planned_file_bytes(world: int, offload_dir: Path) -> float:
    config: dict[str, Any] = {
        "model": {
            "name": "llama",
            "size": "tiny",
            "overrides": {"dim": 32, "n_heads": 2, "n_kv_heads": 1},  # zero_workers' built-in
        },
        "data": {"seq_len": zero_workers.SEQ},
        "train": {"global_batch_size": zero_workers.GLOBAL_BATCH, "micro_batch_size": 4},
        "parallel": {"dp_strategy": "zero1"},
        "zero": {"offload": {"device": "nvme", "path": str(offload_dir)}},
    }
    # The ranks train on the CPU: a device that is its own host.
    cpu = dataclasses.replace(DEVICES["A100-80GB"], host_memory_bytes=None)
    job = job_for_config(config, world=world, per_node=world, device=cpu)
    layout = layout_from_config(config, world=world)
    assert layout.offload == "nvme" and layout.zero == 1
    return estimate_memory(job, layout).disk_optimizer_state


def test_zero1_with_files_trains_as_without_and_holds_what_was_planned(tmp_path: Path) -> None:
    offload_dir = tmp_path / "offload"
    files = {"offload": {"device": "nvme", "path": str(offload_dir)}}
    runs = [
        {"strategy": "zero1", "micro_batch": 4, "builtin": True},
        {"strategy": "zero1", "micro_batch": 4, "builtin": True, "zero": files},
    ]
    results = run_distributed(zero_workers.train_runs, 2, runs, timeout=240)
    planned = _planned_file_bytes(2, offload_dir)
    for plain, offloaded in results:
        assert plain["losses"][-1] < plain["losses"][0], "no progress"
        # The same optimizer over the same shards, its state stored elsewhere between steps.
        torch.testing.assert_close(
            torch.tensor(offloaded["losses"]), torch.tensor(plain["losses"]), rtol=0, atol=0
        )
        memory = offloaded["memory"]
        assert memory["optimizer_state"] == 0, memory  # nothing resident between steps
        measured = memory["offloaded_optimizer_state"]
        assert planned == pytest.approx(8 * offloaded["num_params"] / 2)  # fp32 AdamW
        assert planned <= measured <= planned * (1 + PADDING_TOL), (measured, planned)
        assert plain["memory"]["optimizer_state"] == pytest.approx(measured, rel=PADDING_TOL)
    assert not any(offload_dir.iterdir()), "offload files must be removed at exit"
