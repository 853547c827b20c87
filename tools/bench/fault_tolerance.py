"""Training time lost to one SIGKILL: fault-tolerant replica groups against torchrun restarts.

    python tools/bench/fault_tolerance.py [--steps 40] [--kill-after 10] [--checkpoint-every 5]

The same job (the tiny Llama on CPU, two data-parallel copies, `--steps` steps) runs four times,
each through `plait train` as a user would start it:

- **restart**: one torchrun world of 2 ranks, `--max-restarts 1`, a checkpoint every
  `--checkpoint-every` steps; without a failure, then with rank 1 SIGKILLed after step
  `--kill-after` (`resilience.fault_injection`): torchrun restarts both ranks, which resume
  from the last checkpoint and redo the steps since.
- **fault tolerance**: two replica groups of 1 rank under the lighthouse of a `plait daemon
  --lighthouse`, each group `--max-restarts 1`; without a failure, then with group 1 SIGKILLed
  after the same step: group 0 retries one step alone and trains on, group 1 restarts and heals
  from it.

The time lost is the run's wall time with the failure minus without it (for fault tolerance,
the surviving group's). The table prints both and their ratio. Wall times on a loaded machine
vary: compare the two rows of one run, not runs with each other.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "tiny.toml"
PLAIT = [sys.executable, "-m", "plait.tools.cli"]


@dataclass(frozen=True, slots=True)
class Timing:
    mode: str
    clean_seconds: float
    failed_seconds: float

    @property
    def lost_seconds(self) -> float:
        return self.failed_seconds - self.clean_seconds


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _common(steps: int) -> list[str]:
    return [
        "--set",
        f"train.steps={steps}",
        "--set",
        "train.device=cpu",
        "--set",
        "telemetry.enabled=false",
        "--set",
        "train.log_every=1000",
    ]


def _kill(after: int, rank: int) -> list[str]:
    return [
        "--set",
        f"resilience.fault_injection.kill_after_step={after}",
        "--set",
        f"resilience.fault_injection.rank={rank}",
    ]


def _run(command: list[str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as out:
        subprocess.run(command, check=True, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    return time.perf_counter() - start


def restart_run(work: Path, *, steps: int, kill_after: int | None, every: int) -> float:
    """Wall time of one torchrun world of 2 ranks that restarts from its checkpoints."""
    name = "clean" if kill_after is None else "killed"
    command = [
        *PLAIT,
        "train",
        str(CONFIG),
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        *_common(steps),
        "--set",
        f"checkpoint_io.dir={work / f'restart-{name}'}",
        "--set",
        f"checkpoint_io.every={every}",
        *([] if kill_after is None else _kill(kill_after, 1)),
    ]
    return _run(command, work / f"restart-{name}.log")


def fault_tolerant_run(work: Path, *, steps: int, kill_after: int | None) -> float:
    """Wall time of the surviving replica group (group 0) of a 2-group fault-tolerant job."""
    name = "clean" if kill_after is None else "killed"
    lighthouse = f"127.0.0.1:{_free_port()}"
    daemon = subprocess.Popen(
        [
            *PLAIT,
            "daemon",
            "--bind",
            f"127.0.0.1:{_free_port()}",
            "--lighthouse",
            lighthouse,
            "--no-calibrate",
        ],
        stdout=(work / f"daemon-{name}.log").open("w"),
        stderr=subprocess.STDOUT,
        cwd=ROOT,
    )
    try:
        groups = []
        for group in (0, 1):
            command = [
                *PLAIT,
                "train",
                str(CONFIG),
                "--max-restarts",
                "1",
                *_common(steps),
                "--set",
                f"fault_tolerance.replica_group={group}",
                "--set",
                "fault_tolerance.replica_groups=2",
                "--set",
                f"fault_tolerance.lighthouse={lighthouse}",
                "--set",
                f"telemetry.job_id=ft-bench-{name}",
                *([] if kill_after is None or group == 0 else _kill(kill_after, 0)),
            ]
            log = (work / f"ft-{name}-group{group}.log").open("w")
            groups.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        start = time.perf_counter()
        if groups[0].wait() != 0:
            raise RuntimeError(f"group 0 failed; see {work / f'ft-{name}-group0.log'}")
        survivor_seconds = time.perf_counter() - start
        groups[1].wait()
        return survivor_seconds
    finally:
        daemon.terminate()
        daemon.wait(30)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kill-after", type=int, default=10)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--keep", type=Path, help="keep the logs in this directory")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="plait-ft-bench-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        timings = [
            Timing(
                f"torchrun --max-restarts 1, checkpoint every {args.checkpoint_every}",
                restart_run(work, steps=args.steps, kill_after=None, every=args.checkpoint_every),
                restart_run(
                    work, steps=args.steps, kill_after=args.kill_after, every=args.checkpoint_every
                ),
            ),
            Timing(
                "fault tolerance, 2 replica groups",
                fault_tolerant_run(work, steps=args.steps, kill_after=None),
                fault_tolerant_run(work, steps=args.steps, kill_after=args.kill_after),
            ),
        ]
    print(f"{args.steps} steps, one SIGKILL after step {args.kill_after}")
    print(f"{'mode':<48} {'clean s':>9} {'killed s':>9} {'lost s':>8}")
    for timing in timings:
        print(
            f"{timing.mode:<48} {timing.clean_seconds:9.1f} {timing.failed_seconds:9.1f} "
            f"{timing.lost_seconds:8.1f}"
        )
    restart, tolerant = timings
    if tolerant.lost_seconds > 0:
        ratio = restart.lost_seconds / tolerant.lost_seconds
        print(f"time lost, restart / fault tolerance: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
