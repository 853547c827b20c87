"""Runs a user's training script under torchrun exactly as written, with what a test needs
around it, from outside the script: a slow rank and a stalled forward (global module hooks, as
a slow device would be), its printed lines and its trainer's state written to a JSON file.

    torchrun --nproc-per-node 2 launch.py SCRIPT OUT_DIR

`OBSERVED_SLOW_RANK` / `OBSERVED_SLOW_FACTOR`: that rank's every outer forward takes FACTOR
times longer than it took (slow in proportion, however loaded the machine is).
`OBSERVED_STALL_RANK` / `OBSERVED_STALL_CALL` / `OBSERVED_STALL_UNTIL`: that rank's outer
forward number CALL (0-based) writes the job's id to UNTIL + ".reached" and waits until UNTIL
exists (at most 240 s), so the other rank waits in the collective that follows: a hang, for
the daemon, until the test has done what it does while the rank is stuck and creates UNTIL.
The report also has the model's parameter bytes (a sharded parameter counted whole).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import runpy
import sys
import time
from pathlib import Path

import torch


def main() -> None:
    script, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    slow = float(os.environ.get("OBSERVED_SLOW_FACTOR", "0"))
    slow_rank = int(os.environ.get("OBSERVED_SLOW_RANK", "-1"))
    stall_rank = int(os.environ.get("OBSERVED_STALL_RANK", "-1"))
    stall_call = int(os.environ.get("OBSERVED_STALL_CALL", "-1"))
    stall_until = Path(os.environ.get("OBSERVED_STALL_UNTIL", "/nonexistent"))
    depth, calls, started = [0], [0], [0.0]

    def enter(module: torch.nn.Module, args: object) -> None:
        if not depth[0]:
            started[0] = time.perf_counter()
        depth[0] += 1

    def leave(module: torch.nn.Module, args: object, output: object) -> None:
        # Global hooks run before a module's own: this sleep is inside the observed forward.
        depth[0] -= 1
        if depth[0]:
            return
        if rank == slow_rank:
            time.sleep(slow * (time.perf_counter() - started[0]))
        if rank == stall_rank and calls[0] == stall_call:
            stall_until_released(stall_until)
        calls[0] += 1

    torch.nn.modules.module.register_module_forward_pre_hook(enter)
    torch.nn.modules.module.register_module_forward_hook(leave)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        scope = runpy.run_path(str(script), run_name="__main__")
    report: dict[str, object] = {
        "rank": rank,
        "job_id": os.environ.get("TORCHELASTIC_RUN_ID", ""),
        "lines": printed.getvalue().splitlines(),
    }
    model = scope.get("model")
    if isinstance(model, torch.nn.Module):
        # The hand formula's N: the weights of every matmul (embedding tables do none).
        report["dense_weights"] = sum(
            m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear)
        )
        report["parameter_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    for name in ("batch_size", "seq_len", "steps"):
        if name in scope:
            report[name] = scope[name]
    trainer = scope.get("trainer")
    if hasattr(trainer, "state") and hasattr(trainer.state, "log_history"):  # transformers
        report["global_step"] = trainer.state.global_step
        report["log_history"] = trainer.state.log_history
    elif hasattr(trainer, "callback_metrics"):  # Lightning
        report["global_step"] = trainer.global_step
        report["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    sys.stdout.write(printed.getvalue())


def stall_until_released(until: Path) -> None:
    """The stalled forward (named, so that its stack shows where the rank is)."""
    reached = until.with_name(until.name + ".reached")
    written = reached.with_name(reached.name + ".tmp")
    written.write_text(os.environ.get("TORCHELASTIC_RUN_ID", ""))  # the job's id
    written.rename(reached)  # whole, for whoever waits for it
    deadline = time.monotonic() + 240
    while not until.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
