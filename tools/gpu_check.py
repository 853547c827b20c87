"""One prepared run that proves plait on a GPU node, within a time budget, keeping what it got.

    python tools/gpu_check.py --out DIR [--budget-seconds 300] [--wheelhouse DIR] [--rehearse]
                              [--stages environment,gpu_tier,…]

Stages, in this order, each under its own time cap (its share of the budget still left), each
written to `DIR/summary.json` as soon as it ends — a run cut off part-way keeps every finished
stage — with its processes' output in `DIR/<stage>.log`:

1. `environment`: GPU, driver, torch / CUDA / triton / NCCL versions; with `--wheelhouse`,
   plait and what the node lacks installed from it first (`make wheelhouse`).
2. `gpu_tier`: `tests/gpu` with a per-test timeout, slowest files last.
3. `bench`: `tools/bench/gpu.py --quick` (a 1B Llama at T = 2048 in bf16: plait with torch and
   Triton kernels, compiled, and with each op's provider chosen by measurement (`plait auto`),
   against a plain PyTorch loop eager and compiled: tokens/s, MFU, peak memory, the providers
   `auto` chose), then `tools/bench/kernels.py` (each Triton kernel against `torch.compile` of
   its reference).
4. `fp8`: `tools/bench/fp8.py` (plait's fp8 linear layers against torchao's float8 training
   and bf16 on the 1B Llama, compiled, 200 steps: tokens/s and the loss against bf16).
5. `compile`: `tools/bench/compile.py --device cuda --only zero3,tp+sp` (compiled blocks against
   eager ones, inductor, AMP bf16, one NCCL rank per GPU, a Llama d = 1024, L = 8 at T = 1024):
   the compiled / eager ratios per layout; on a node with one GPU ZeRO-3 runs on one rank and
   tp + sp is reported as skipped, with the reason.
6. `training`: a node daemon with the real NVML collector and a 1-rank `plait train` exporting
   to it; `plait top / bottleneck / status --json` and the daemon's `hw.*` metrics.
7. `cpu`: the 8-rank layouts against one process (`tests/dist/test_eight_ranks.py` at a larger
   size; started in the background after `environment`, on the upper half of the cores, since it
   needs no GPU) and `tools/bench/daemon_load.py --ingest-workers 4 --flooders 8
   --client-processes 4`.
8. `profile`: `plait profile` of a GPU run, where this build has the command.

`--rehearse` runs every stage on a CPU machine at tiny sizes, so the plumbing is proven before a
GPU minute is spent (the test suite runs it). Only the standard library is imported here: plait
and its dependencies may not be installed until the first stage has run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
GPU_TIER = REPO_ROOT / "tests" / "gpu"
# Fastest first, so a run cut off at its cap still has most of the tier; files not named here
# run after these and before the two slowest.
GPU_TIER_ORDER = (
    "test_nvml_real.py",
    "test_triton_compiled.py",
    "test_expert_load_gpu.py",
    "test_triton_tuning_gpu.py",
)
GPU_TIER_LAST = ("test_engine_gpu.py", "test_fp8_gpu.py")
EIGHT_RANKS = REPO_ROOT / "tests" / "dist" / "test_eight_ranks.py"
KILL_GRACE_SECONDS = 5.0


@dataclass(slots=True)
class Check:
    """What every stage shares: where to write, the budget's end, the mode."""

    out: Path
    deadline: float
    rehearse: bool
    wheelhouse: Path | None
    gpu_tests: list[str] = field(default_factory=list)  # empty: the whole tier
    kernel_bench: bool = True
    python: str = sys.executable
    summary: dict[str, Any] = field(default_factory=dict)
    background: dict[str, subprocess.Popen] = field(default_factory=dict)
    background_deadline: float = 0.0

    def log(self, message: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')}] {message}"
        print(line, flush=True)
        with (self.out / "gpu_check.log").open("a") as log:
            log.write(line + "\n")

    def save(self) -> None:
        scratch = self.out / "summary.json.tmp"
        scratch.write_text(json.dumps(self.summary, indent=2, default=str))
        scratch.replace(self.out / "summary.json")

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
        if not self.rehearse:
            env["TRITON_INTERPRET"] = "0"  # the GPU compiles Triton kernels
        return env


@dataclass(frozen=True, slots=True)
class Ran:
    code: int | None  # None: killed at its cap
    seconds: float

    @property
    def timed_out(self) -> bool:
        return self.code is None


def start(check: Check, command: Sequence[str], log_name: str, **env: str) -> subprocess.Popen:
    """A command in its own process group (so its children go with it at the cap), its output
    appended to `DIR/<log_name>.log`."""
    log = (check.out / f"{log_name}.log").open("a")
    log.write(f"$ {' '.join(command)}\n")
    log.flush()
    return subprocess.Popen(
        list(command),
        cwd=REPO_ROOT,
        env=check.env(**env),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def finish(process: subprocess.Popen, deadline: float) -> int | None:
    """Wait for `process` until `deadline`; past it, end its whole group. None if it was cut."""
    try:
        return process.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    for sig, grace in ((signal.SIGTERM, KILL_GRACE_SECONDS), (signal.SIGKILL, None)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        try:
            process.wait(timeout=grace)
            break
        except (subprocess.TimeoutExpired, TypeError):
            continue
    process.wait()
    return None


def run(check: Check, command: Sequence[str], log_name: str, deadline: float, **env: str) -> Ran:
    began = time.monotonic()
    code = finish(start(check, command, log_name, **env), deadline)
    return Ran(code, round(time.monotonic() - began, 1))


def read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def read_test_outcomes(path: Path) -> list[dict[str, Any]]:
    """What `plait.tools.pytest_outcomes` wrote, one test a line, as each test finished (a
    line cut short by a kill is dropped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return found


def pytest_command(check: Check, *arguments: str) -> list[str]:
    return [
        check.python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
        "-p", "plait.tools.pytest_outcomes", *arguments,
    ]  # fmt: skip


def tally(cases: list[dict[str, Any]]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for case in cases:
        counts[case["outcome"]] = counts.get(case["outcome"], 0) + 1
    return counts


# -- the stages --------------------------------------------------------------------------------

PROBE = r"""
import json, platform, sys
found = {"python": platform.python_version()}
from importlib import metadata
def version(distribution):
    try:
        return metadata.version(distribution)
    except Exception as exc:
        return f"not installed: {type(exc).__name__}: {exc}"[:200]
import torch
found["torch"] = torch.__version__
found["cuda_runtime"] = torch.version.cuda
found["cuda_available"] = torch.cuda.is_available()
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    found["gpu"] = props.name
    found["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
    found["capability"] = list(torch.cuda.get_device_capability(0))
    found["multiprocessors"] = props.multi_processor_count
    found["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    found["cudnn"] = torch.backends.cudnn.version()
for name in ("triton", "transformers", "grpcio", "protobuf", "pydantic", "nvidia-ml-py",
             "opentelemetry-sdk", "pytest", "pytest-timeout"):
    found[name] = version(name)
try:
    import plait
    from plait.daemon.server import DaemonServer  # the generated protos and their runtimes
    from plait.core.engine import Engine
    found["plait"] = version("plait")
    found["plait_path"] = plait.__file__
except Exception as exc:
    found["plait"] = f"not importable: {type(exc).__name__}: {exc}"[:400]
print("PROBE " + json.dumps(found))
"""


def environment(check: Check, deadline: float) -> dict[str, Any]:
    result: dict[str, Any] = {}
    if shutil.which("nvidia-smi"):
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        smi = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=30, check=False,
        )  # fmt: skip
        result["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    if check.wheelhouse is not None:
        result["install"] = install(check, check.wheelhouse, deadline)
    ran = run(check, [check.python, "-c", PROBE], "environment", deadline)
    text = (check.out / "environment.log").read_text()
    probes = [line for line in text.splitlines() if line.startswith("PROBE ")]
    if probes:
        result.update(json.loads(probes[-1][len("PROBE ") :]))
    result["probe_exit_code"] = ran.code
    ready = ran.code == 0 and not str(result.get("plait", "")).startswith("not importable")
    if not check.rehearse:
        ready = ready and bool(result.get("cuda_available"))
    result["status"] = "passed" if ready else "failed"
    return result


def install(check: Check, wheelhouse: Path, deadline: float) -> dict[str, Any]:
    """plait from the wheelhouse, keeping every installed package that satisfies it; the plait
    wheel itself always replaces an installed one (it is the build under test)."""
    pip = [check.python, "-m", "pip", "install", "--no-index", "--no-cache-dir", "--no-compile"]
    # With torchao in the wheelhouse (`make wheelhouse`, extra fp8), the fp8 stage's peer too.
    wanted = "plait[fp8]" if any(wheelhouse.glob("torchao-*.whl")) else "plait"
    resolved = run(check, [*pip, "--find-links", str(wheelhouse), wanted], "environment", deadline)
    outcome: dict[str, Any] = {"resolved_exit_code": resolved.code}
    if resolved.code != 0:  # the node's packages conflict: take every wheel as it is
        wheels = sorted(str(w) for w in wheelhouse.glob("*.whl"))
        forced = run(check, [*pip, "--no-deps", *wheels], "environment", deadline)
        outcome["forced_exit_code"] = forced.code
    (plait_wheel,) = wheelhouse.glob("plait-*.whl")
    fresh = run(
        check, [*pip, "--no-deps", "--force-reinstall", str(plait_wheel)], "environment", deadline
    )
    outcome["plait_exit_code"] = fresh.code
    log = (check.out / "environment.log").read_text()
    outcome["installed"] = [
        line.split("Successfully installed ", 1)[1]
        for line in log.splitlines()
        if "Successfully installed " in line
    ]
    return outcome


def gpu_tier_files() -> list[Path]:
    every = sorted(p.name for p in GPU_TIER.glob("test_*.py"))
    middle = [n for n in every if n not in GPU_TIER_ORDER and n not in GPU_TIER_LAST]
    ordered = [*GPU_TIER_ORDER, *middle, *GPU_TIER_LAST]
    return [GPU_TIER / name for name in ordered if name in every]


def gpu_tier(check: Check, deadline: float) -> dict[str, Any]:
    outcomes = check.out / "gpu_tier.jsonl"
    per_test = max(45, min(120, int((deadline - time.monotonic()) / 2.5)))
    selected = check.gpu_tests or [str(path) for path in gpu_tier_files()]
    command = pytest_command(check, f"--timeout={per_test}", *selected)
    ran = run(check, command, "gpu_tier", deadline, PLAIT_TEST_OUTCOMES=str(outcomes))
    cases = read_test_outcomes(outcomes)
    counts = tally(cases)
    broken = counts.get("failed", 0) + counts.get("error", 0)
    status = "timed_out" if ran.timed_out else ("failed" if broken else "passed")
    return {
        "status": status,
        "exit_code": ran.code,
        "per_test_timeout": per_test,
        "counts": counts,
        "tests": cases,
    }


def bench(check: Check, deadline: float) -> dict[str, Any]:
    model_json, kernels_json = check.out / "bench.json", check.out / "kernels.json"
    mode = "--smoke" if check.rehearse else "--quick"
    # The model bench first, with three quarters of the stage; the kernels get the rest.
    share = 0.75 if check.kernel_bench else 1.0
    model_deadline = time.monotonic() + share * (deadline - time.monotonic())
    command = [check.python, "-m", "plait.tools.bench.gpu", mode, "--json", str(model_json)]
    model = run(check, command, "bench", model_deadline)
    command = [check.python, "-m", "plait.tools.bench.kernels", "--json", str(kernels_json)]
    kernels = run(check, command, "bench", deadline) if check.kernel_bench else Ran(0, 0.0)
    figures = read_json(model_json) or {}
    rows = (read_json(kernels_json) or {}).get("rows", [])
    result = {
        "model": figures,
        "model_exit_code": model.code,
        "kernels": kernel_ratios(rows),
        "kernels_exit_code": kernels.code,
    }
    variants = figures.get("variants", {})
    if model.timed_out or kernels.timed_out:
        result["status"] = "timed_out"
    elif model.code != 0 or kernels.code != 0 or figures.get("failed") or not variants:
        result["status"] = "failed"
    else:
        result["status"] = "passed"
    return result


def fp8(check: Check, deadline: float) -> dict[str, Any]:
    """`tools/bench/fp8.py`: plait fp8 against torchao float8 and bf16 (tokens/s, loss after
    200 steps); the script saves its figures after every round, so a cut-off run keeps some."""
    out = check.out / "fp8.json"
    mode = ["--smoke"] if check.rehearse else ["--steps", "200", "--chunk", "20"]
    command = [check.python, "-m", "plait.tools.bench.fp8", *mode, "--json", str(out)]
    ran = run(check, command, "fp8", deadline)
    figures = read_json(out) or {}
    status = "timed_out" if ran.timed_out else ("passed" if ran.code == 0 else "failed")
    if status == "passed" and not figures.get("variants"):
        status = "failed"
    return {"status": status, "exit_code": ran.code, "figures": figures}


COMPILE_LAYOUTS = "zero3,tp+sp"
# The GPU run: a model whose step the GPU, not the launches, sets (8k tokens a step), compiled
# in well under a minute (the blocks share one graph); 3 warm-up steps (the first compiles).
COMPILE_GPU = ["--device", "cuda", "--rounds", "1", "--warmup", "3", "--steps", "20",
               "--dim", "1024", "--layers", "8", "--vocab", "32000", "--seq-len", "1024",
               "--global-batch", "8"]  # fmt: skip
# The rehearsal: the one-GPU plan on a CPU (`--devices 1`: ZeRO-3 on one rank started as on
# the node, tp + sp skipped), tiny, one step, and the `eager` backend (dynamo traces the blocks;
# inductor would spend 25 s compiling C++ here).
COMPILE_REHEARSAL = ["--device", "cpu", "--devices", "1", "--backend", "eager",
                     "--rounds", "1", "--warmup", "1", "--steps", "1", "--dim", "64",
                     "--layers", "1", "--vocab", "256", "--seq-len", "16",
                     "--global-batch", "2"]  # fmt: skip


def compiled_blocks(check: Check, deadline: float) -> dict[str, Any]:
    """`tools/bench/compile.py` on the GPU: compiled blocks against eager ones under ZeRO-3 and
    tp + sp (skipped, with the reason, on fewer than two GPUs); the script saves its figures
    after every run, so a cut-off run keeps the eager one."""
    out = check.out / "compile.json"
    mode = COMPILE_REHEARSAL if check.rehearse else COMPILE_GPU
    command = [check.python, "-m", "plait.tools.bench.compile", "--only", COMPILE_LAYOUTS,
               *mode, "--json", str(out)]  # fmt: skip
    ran = run(check, command, "compile", deadline)
    figures = read_json(out) or {}
    ratios, skipped = figures.get("ratios", {}), figures.get("skipped", {})
    layouts = figures.get("layouts", {})
    measured = bool(layouts) and all(name in ratios for name in layouts if name not in skipped)
    status = "passed" if ran.code == 0 and measured else "failed"
    if ran.timed_out:
        status = "timed_out"
    contenders = figures.get("contenders", {})
    return {
        "status": status,
        "exit_code": ran.code,
        "device": figures.get("device_name"),
        "precision": figures.get("precision"),
        "layouts": layouts,  # ranks, backend and rendezvous per layout, or why it was skipped
        "ratios": ratios,
        # per layout: the largest compiled-vs-eager loss difference at any step, recompilations
        "equality": figures.get("equality", {}),
        "skipped": skipped,
        "medians": {name: entry["median"] for name, entry in contenders.items()},
        "watch": {name: entry["runs"][-1].get("watch") for name, entry in contenders.items()},
    }


def kernel_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per op and pass: milliseconds of torch, torch.compile and triton, and triton's speed-up
    over torch.compile (> 1: the Triton kernel is faster)."""
    table: dict[tuple[str, str, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["op"], row["shape"], row["pass_"])
        entry = table.setdefault(key, {"op": key[0], "shape": key[1], "pass": key[2]})
        entry[row["provider"]] = row.get("ms", row.get("error"))
    for entry in table.values():
        triton, compiled = entry.get("triton"), entry.get("torch.compile")
        if isinstance(triton, float) and isinstance(compiled, float):
            entry["triton_vs_compile"] = round(compiled / triton, 3)
    return list(table.values())


def training(check: Check, deadline: float) -> dict[str, Any]:
    out = check.out / "training"
    # The rank trains until the live views and a capture are in; then it is stopped.
    device = "cpu" if check.rehearse else "cuda"
    timeout = str(max(10, int(deadline - time.monotonic()) - 15))
    command = [
        check.python, "-m", "plait.tools.gpu_check_training", "--out", str(out),
        "--device", device, "--timeout", timeout,
    ]  # fmt: skip
    ran = run(check, command, "training", deadline)
    found = read_json(out / "training.json") or {}
    top, bottleneck = found.get("top") or {}, found.get("bottleneck") or {}
    ok = ran.code == 0 and bool(top.get("ranks")) and bool(bottleneck.get("ranks"))
    return {
        "status": "timed_out" if ran.timed_out else ("passed" if ok else "failed"),
        "exit_code": ran.code,
        "train_exit_code": found.get("train_exit_code"),
        "stopped_after_views": (found.get("live") or {}).get("stopped_after_views", False),
        "train_seconds": found.get("train_seconds"),
        "gpu_collector": found.get("gpu_collector"),
        "profile": (found.get("live") or {}).get("profile"),
        "live_top_ranks": (found.get("live") or {}).get("top", {}).get("ranks"),
        "live_bottleneck_ranks": (found.get("live") or {}).get("bottleneck", {}).get("ranks"),
        "top_ranks": top.get("ranks"),
        "bottleneck_ranks": bottleneck.get("ranks"),
        "status_view": found.get("status"),
        "hw_metrics": found.get("hw_metrics", [])[:40],
        "errors": {k: v for k, v in found.items() if k.endswith("_error")},
    }


def start_eight_ranks(check: Check, deadline: float) -> None:
    """The 8-rank layouts need CPU only: they run beside the GPU stages, on the upper half of
    a large node's cores (the GPU stages keep the lower half)."""
    command = pytest_command(check, str(EIGHT_RANKS))
    cores = os.cpu_count() or 1
    if cores >= 16 and shutil.which("taskset"):
        command = ["taskset", "-c", f"{cores // 2}-{cores - 1}", *command]
    scale = "rehearsal" if check.rehearse else "large"
    outcomes = str(check.out / "eight_ranks.jsonl")
    process = start(
        check, command, "cpu", PLAIT_EIGHT_RANK_SCALE=scale, PLAIT_TEST_OUTCOMES=outcomes
    )
    check.background["eight_ranks"] = process
    check.background_deadline = deadline


def cpu(check: Check, deadline: float) -> dict[str, Any]:
    result: dict[str, Any] = {"cpus": os.cpu_count()}
    process = check.background.pop("eight_ranks", None)
    if process is None:
        result["eight_ranks"] = {"status": "not started"}
    else:
        # The background run keeps the time it was given at its start, within this stage's.
        code = finish(process, min(deadline, check.background_deadline))
        cases = read_test_outcomes(check.out / "eight_ranks.jsonl")
        counts = tally(cases)
        broken = counts.get("failed", 0) + counts.get("error", 0)
        result["eight_ranks"] = {
            "status": "timed_out" if code is None else ("failed" if broken else "passed"),
            "exit_code": code,
            "counts": counts,
            "tests": cases,
        }
    load_json = check.out / "daemon_load.json"
    # Clients query once a second, as `plait top` refreshes, while 8 exporters flood the daemon;
    # on the node they are 4 processes of 8, as operators' `plait top`s are processes of their own.
    if check.rehearse:
        load = ["--ingest-workers", "1", "--flooders", "1", "--ranks", "1", "--clients", "2",
                "--client-processes", "2", "--seconds", "1", "--query-interval", "0.5"]  # fmt: skip
    else:
        load = ["--ingest-workers", "4", "--flooders", "8", "--seconds", "8",
                "--client-processes", "4", "--query-interval", "1"]  # fmt: skip
    command = [check.python, "-m", "plait.tools.bench.daemon_load", *load, "--json", str(load_json)]
    ran = run(check, command, "cpu", deadline)
    figures = read_json(load_json)
    result["daemon_load"] = {"exit_code": ran.code, "figures": figures}
    parts = [result["eight_ranks"]["status"], "passed" if ran.code == 0 and figures else "failed"]
    if ran.timed_out:
        parts.append("timed_out")
    result["status"] = next((s for s in ("timed_out", "failed") if s in parts), "passed")
    if "not started" in parts:
        result["status"] = "failed"
    return result


def profile(check: Check, deadline: float) -> dict[str, Any]:
    """The capture the training stage asked for while its rank trained (a capture needs a
    running job): the analysis as `plait profile --json` gave it."""
    del deadline
    training = check.summary["stages"].get("training", {})
    capture = training.get("profile")
    if capture is None:
        ran = run(check, [check.python, "-m", "plait.tools.cli", "profile", "--help"],
                  "profile", time.monotonic() + 60)  # fmt: skip
        reason = "the training stage did not run" if ran.code == 0 else "no `plait profile` here"
        return {"status": "skipped", "reason": reason}
    ok = capture.get("exit_code") == 0 and capture.get("trace_bytes", 0) > 0
    return {"status": "passed" if ok else "failed", **capture}


@dataclass(frozen=True, slots=True)
class Stage:
    name: str
    share: float  # of the budget still left when the stage starts, among the stages left
    body: Callable[[Check, float], dict[str, Any]]


# The bench has the largest share: its compiled variants (the plain loop's and plait's, and
# `plait auto` timing `torch.compile` of each op) spend a minute or more compiling before a
# step is timed, and at the earlier 0.36 they did not finish within an 8-minute check. The
# compile stage's 0.10 comes from the bench (0.40 → 0.34) and the GPU tier (0.20 → 0.16): the
# 1B bench's compiled variants have not finished inside any check so far, while the compile
# stage's small blocks compile in under a minute and give the compiled ZeRO-3 (and, on two
# GPUs, tp + sp) figures a CPU cannot; the bench's eager variants and the tier keep the rest.
STAGES = (
    Stage("environment", 0.06, environment),
    Stage("gpu_tier", 0.16, gpu_tier),
    Stage("bench", 0.34, bench),
    Stage("fp8", 0.10, fp8),
    Stage("compile", 0.10, compiled_blocks),
    Stage("training", 0.10, training),
    Stage("cpu", 0.12, cpu),
    Stage("profile", 0.02, profile),
)


def run_stages(check: Check, names: Sequence[str]) -> None:
    chosen = [stage for stage in STAGES if stage.name in names]
    for index, stage in enumerate(chosen):
        now = time.monotonic()
        left = check.deadline - now
        shares = sum(s.share for s in chosen[index:])
        cap = max(0.0, left * stage.share / shares)
        check.log(f"{stage.name}: up to {cap:.0f} s ({left:.0f} s of the budget left)")
        began = time.monotonic()
        try:
            result = stage.body(check, now + cap) if cap >= 1 else {"status": "no time left"}
        except Exception as exc:  # a broken stage must not cost the stages after it
            result = {"status": "error", "error": traceback.format_exc()[-3000:]}
            check.log(f"{stage.name}: {type(exc).__name__}: {exc}")
        result["seconds"] = round(time.monotonic() - began, 1)
        result["cap_seconds"] = round(cap, 1)
        check.summary["stages"][stage.name] = result
        check.save()
        check.log(f"{stage.name}: {result['status']} in {result['seconds']} s")
        if stage.name == "environment" and "cpu" in names and EIGHT_RANKS.exists():
            start_eight_ranks(check, background_deadline(check, chosen[index + 1 :]))
    for name, process in check.background.items():  # a background run whose stage never came
        finish(process, time.monotonic())
        check.log(f"{name}: stopped (its stage did not run)")


def background_deadline(check: Check, later: Sequence[Stage]) -> float:
    """When the 8-rank run must end: by the middle of the `cpu` stage, as the shares of the
    stages left foretell it, leaving the rest of that stage to the ingest bench."""
    share = 0.0
    for stage in later:
        if stage.name == "cpu":
            share += stage.share / 2
            break
        share += stage.share
    total = sum(stage.share for stage in later)
    return time.monotonic() + (check.deadline - time.monotonic()) * share / total


def print_table(summary: dict[str, Any]) -> None:
    print("\nstage         status      seconds")
    for name, result in summary["stages"].items():
        print(f"{name:13} {result['status']:11} {result.get('seconds', 0):7}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="results directory")
    parser.add_argument("--budget-seconds", type=float, default=300.0)
    parser.add_argument("--wheelhouse", type=Path, help="install plait from these wheels first")
    parser.add_argument("--rehearse", action="store_true", help="every stage, tiny, on a CPU")
    parser.add_argument(
        "--stages", default=",".join(s.name for s in STAGES), help="comma-separated stage names"
    )
    parser.add_argument(
        "--no-kernel-bench", action="store_true", help="the bench stage times the model only"
    )
    parser.add_argument(
        "--gpu-tests",
        default="",
        help="comma-separated test paths or ids for the gpu_tier stage (default: all of it)",
    )
    args = parser.parse_args(argv)
    names = [name for name in args.stages.split(",") if name]
    unknown = set(names) - {s.name for s in STAGES}
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; known: {[s.name for s in STAGES]}")
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(
        out=args.out,
        deadline=time.monotonic() + args.budget_seconds,
        rehearse=args.rehearse,
        wheelhouse=args.wheelhouse,
        gpu_tests=[test for test in args.gpu_tests.split(",") if test],
        kernel_bench=not args.no_kernel_bench,
    )
    check.summary = {
        "rehearse": args.rehearse,
        "budget_seconds": args.budget_seconds,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "stages": {},
    }
    check.save()
    run_stages(check, names)
    check.summary["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    check.save()
    print_table(check.summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
