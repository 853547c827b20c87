"""A node daemon and a 1-rank `plait train` exporting to it, as an operator would run them; the
operator's views saved as JSON (a stage of `tools/gpu_check.py`).

    python -m plait.tools.gpu_check_training --out DIR [--device cuda] [--steps 20]

The daemon runs in this process with its real collectors (NVML where the GPU and nvidia-ml-py
are, else the host's) and serves `/metrics`. The rank is launched by `plait train` (torchrun)
with `PLAIT_DAEMON` pointing at the daemon. While it trains, `plait top --json` and
`plait bottleneck --json` over the last `LIVE_WINDOW` steps are asked every few seconds (the
last answer kept: live MFU once warm-up has left the window, GPU utilization while busy, as an
operator sees them); where this build has `plait profile`, one capture of `PROFILE_STEPS`
steps is asked for then too (`DIR/profile.json.gz`, its analysis kept). Once the rank
finishes: the same views of the whole run and `plait status --json`, and the daemon's `hw.*`
Prometheus lines. `DIR/training.json` sums it up.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from plait.daemon.server import DaemonServer

JOB_ID = "gpu-check"
LIVE_WINDOW = 5  # steps: past the first (CUDA initialisation, kernel compilation) by then
LIVE_POLL_SECONDS = 3.0
PROFILE_STEPS = 2

# CUDA: a Llama large enough to keep the GPU busy between launches; CPU: the rehearsal's size.
MODELS = {
    "cuda": {
        "overrides": {"dim": 1024, "n_layers": 8, "n_heads": 16, "n_kv_heads": 8,
                      "max_seq_len": 1024},
        "seq_len": 1024, "global_batch_size": 8, "micro_batch_size": 8,
    },
    "cpu": {
        "overrides": {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32},
        "seq_len": 32, "global_batch_size": 4, "micro_batch_size": 4,
    },
}  # fmt: skip


def training_config(device: str, steps: int) -> str:
    model = MODELS[device]
    overrides = ", ".join(f"{key} = {value}" for key, value in model["overrides"].items())
    amp = '\n[amp]\ndtype = "bf16"\n' if device == "cuda" else ""
    precision = '\ntransforms = { precision = "amp" }' if device == "cuda" else ""
    return f"""# {Path(__file__).name}: one rank exporting to the node daemon.
[model]
name = "llama"
size = "tiny"
overrides = {{ {overrides} }}

[data]
seq_len = {model["seq_len"]}

[train]
steps = {steps}
global_batch_size = {model["global_batch_size"]}
micro_batch_size = {model["micro_batch_size"]}
device = "{device}"
log_every = 5

[optimizer]
lr = 3e-4
warmup_steps = 2

[parallel]
dp_strategy = "ddp"{precision}
{amp}
[telemetry]
enabled = true
job_id = "{JOB_ID}"
"""


def cli(address: str, *arguments: str, timeout: float = 60.0) -> tuple[int, str, str]:
    """`plait …` as a user runs it; (exit code, stdout, stderr)."""
    command = [sys.executable, "-m", "plait.tools.cli", *arguments, "--host", address]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
    return done.returncode, done.stdout, done.stderr


def hardware_lines(prometheus_address: str) -> list[str]:
    """The daemon's `hw_*` samples (GPU utilization, memory, power, energy; or the host's)."""
    with urllib.request.urlopen(f"http://{prometheus_address}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return [line for line in text.splitlines() if line.startswith("hw_")]


def has_profile_command() -> bool:
    return importlib.util.find_spec("plait.tools.profile_commands") is not None


def watch_live(
    address: str, train: subprocess.Popen, deadline: float, *, capture: Path
) -> dict[str, Any]:
    """The live `top` and `bottleneck` answers once the rank is `LIVE_WINDOW` steps in, then
    one `plait profile` capture (where the build has the command); then the run is stopped as
    an operator stops one, with SIGTERM (the ranks finish their step and exit 143). Driven by
    what the daemon shows, not by a guess of how long the steps take. Killed at `deadline`."""
    live: dict[str, Any] = {}
    profile_wanted = has_profile_command()
    while train.poll() is None:
        if time.monotonic() > deadline:
            train.kill()
            train.wait()
            live["killed_at_timeout"] = True
            break
        if "top" not in live:
            window = ("--window-steps", str(LIVE_WINDOW), "--job", JOB_ID)
            views = ("top", "bottleneck")
            answers = {view: cli(address, view, "--json", *window) for view in views}
            if all(warm(code, stdout) for code, stdout, _ in answers.values()):
                live.update({view: json.loads(out) for view, (_, out, _) in answers.items()})
        if "top" in live and profile_wanted:
            profile_wanted = False
            live["profile"] = profile_once(address, capture)
        if "top" in live and not profile_wanted:
            train.send_signal(signal.SIGTERM)
            live["stopped_after_views"] = True
            train.wait(max(1.0, deadline - time.monotonic()))
            break
        try:
            train.wait(timeout=LIVE_POLL_SECONDS)
        except subprocess.TimeoutExpired:
            continue
    return live


def warm(code: int, stdout: str) -> bool:
    """A view of at least one rank, every one of them `LIVE_WINDOW` steps in."""
    answer = json.loads(stdout) if code == 0 and stdout.strip() else {}
    ranks = [r for r in answer.get("ranks", []) if r.get("steps", r.get("step", 0))]
    return bool(ranks) and min(r.get("step", LIVE_WINDOW) for r in ranks) >= LIVE_WINDOW


def profile_once(address: str, capture: Path) -> dict[str, Any]:
    """`plait profile` of the running job, as an operator asks for it: its JSON answer (the
    analysis: time by class, overlap, idle, the slowest rank) and the trace's size."""
    code, stdout, stderr = cli(
        address, "profile", "--job", JOB_ID, "--steps", str(PROFILE_STEPS),
        "-o", str(capture), "--json", "--timeout", "60", timeout=90,
    )  # fmt: skip
    found: dict[str, Any] = {"exit_code": code}
    if code != 0 or not stdout.strip():
        found["error"] = (stderr or stdout).strip()[-2000:]
        return found
    found["answer"] = json.loads(stdout)
    found["trace_bytes"] = capture.stat().st_size if capture.exists() else 0
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", choices=sorted(MODELS), default="cuda")
    parser.add_argument(
        "--steps", type=int, default=100_000, help="the most steps (the run is stopped earlier)"
    )
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds for the run")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"device": args.device, "steps": args.steps, "job": JOB_ID}
    summary_path = args.out / "training.json"
    config_path = args.out / "training.toml"
    config_path.write_text(training_config(args.device, args.steps))
    server = DaemonServer("127.0.0.1:0", prometheus="127.0.0.1:0").start()
    try:
        summary["gpu_collector"] = server.nvml.status
        env = dict(os.environ, PLAIT_DAEMON=server.address)
        command = [sys.executable, "-m", "plait.tools.cli", "train", str(config_path)]
        began = time.monotonic()
        with (args.out / "training.log").open("w") as log:
            train = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            summary["live"] = watch_live(
                server.address, train, began + args.timeout, capture=args.out / "profile.json.gz"
            )
        summary["train_exit_code"] = train.returncode
        summary["train_seconds"] = round(time.monotonic() - began, 1)
        summary_path.write_text(json.dumps(summary, indent=2))
        for view, arguments in (
            ("top", ("top", "--json", "--all", "--job", JOB_ID)),
            ("bottleneck", ("bottleneck", "--json", "--all", "--job", JOB_ID)),
            ("status", ("status", "--json", "--all")),
        ):
            code, stdout, stderr = cli(server.address, *arguments)
            (args.out / f"{view}.json").write_text(stdout)
            summary[f"{view}_exit_code"] = code
            if code != 0:
                summary[f"{view}_error"] = stderr.strip()[-2000:]
            else:
                summary[view] = json.loads(stdout)
        assert server.prometheus is not None
        summary["hw_metrics"] = hardware_lines(server.prometheus.address)
    finally:
        server.stop(grace=1.0)
        summary_path.write_text(json.dumps(summary, indent=2))
    return 0 if stopped_cleanly(summary) else 1


def stopped_cleanly(summary: dict[str, Any]) -> bool:
    """The rank trained to its last step, or stopped gracefully when this script asked."""
    asked = (summary.get("live") or {}).get("stopped_after_views", False)
    return summary.get("train_exit_code") == (128 + signal.SIGTERM if asked else 0)


if __name__ == "__main__":
    sys.exit(main())
