"""Helpers for tests of plait and of plait plugins: run a function on several Gloo ranks, and
train the tiny built-in model under any layout to compare it with one process.

Plugin authors' pytest suites use these through `plait.testing`, which adds fixtures. Ranks
rendezvous through a `FileStore` in a temporary directory, so tests never need a network
port and cannot collide with each other. Every run has a timeout: a hung rank fails the test
with the ranks that did not finish instead of stalling the suite.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from plait.core.plugins import BUILTIN_PLUGINS

DEFAULT_TIMEOUT = 180.0
# Imported once by the server that forks the ranks (`_rank_context`): torch, the engine and every
# built-in plugin (what each rank's `Plugins.create` imports), and transformers' Llama (what the
# tests of users' models import). A module missing here is skipped by the server, and a rank
# imports it itself. None of them reads the environment or starts a thread when imported, so a
# rank forked from the server holds what a fresh import would.
RANK_PRELOAD = (
    "torch",
    "torch.distributed",
    "plait.core.engine",
    *(module for _, module in BUILTIN_PLUGINS),
    "transformers",
    "transformers.models.llama.modeling_llama",
)


class RankFailure(AssertionError):
    """One or more ranks raised or timed out; the message carries their tracebacks."""


def _rank_main(
    rank: int,
    world_size: int,
    store_path: str,
    result_dir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    # The whole environment of the caller: a forked rank starts with the fork server's.
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    outcome: tuple[str, Any]
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        # Every rank past its share of Gloo's connection set-up before any goes on: a rank
        # whose function makes no collective could otherwise destroy its group (closing its
        # sockets) while a peer still connects to it ("Connection closed by peer" there).
        dist.barrier()
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:
        outcome = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)
    # A forked rank leaves through os._exit, which skips what a process runs when it exits
    # (atexit handlers, weakref finalizers: offload files removed, exporters flushed): run them
    # here, as a spawned rank's exit would (they run once; the list is emptied).
    atexit._run_exitfuncs()


def _rank_context() -> Any:
    """Where ranks start: forked from a server that has imported torch once, where the platform
    has one.

    NOTE: a spawned rank imports torch from scratch: 3.5 s to start two ranks and 7.4 s for four
    on a 2-core machine, against 0.1 s forked from the server (after its own start, once per
    test process); plait's engine and plugins add 1.7 s a rank and transformers' Llama 2 s,
    also paid once by the server. Every rank still imports the test's own modules itself, as a
    spawned one would. A rank's working directory and `sys.path` are
    the caller's (multiprocessing sends them), and `_rank_main` sets the caller's environment.
    """
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(RANK_PRELOAD))
    return ctx


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` Gloo ranks; return each result.

    `fn` must be importable (a module-level function). Results must be picklable.
    """
    ctx = _rank_context()
    with tempfile.TemporaryDirectory(prefix="plait-ranks-") as tmp:
        store_path = str(Path(tmp) / "store")
        base_env = {
            **os.environ,
            "PLAIT_DISABLE_PLUGIN_AUTOLOAD": "1",
            "OMP_NUM_THREADS": "1",
            **(env or {}),
        }
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store_path, tmp, fn, args, base_env),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        results: list[Any] = []
        errors: list[str] = []
        for rank in range(world_size):
            path = Path(tmp) / f"rank{rank}.pkl"
            if not path.exists():
                code = procs[rank].exitcode
                errors.append(
                    f"rank {rank}: "
                    + ("timed out" if rank in hung else f"exited with code {code} and no result")
                )
                results.append(None)
                continue
            status, value = pickle.loads(path.read_bytes())
            if status == "error":
                errors.append(value)
            results.append(value)
        if errors:
            raise RankFailure(
                f"{len(errors)} of {world_size} ranks failed"
                + (f" (timed out after {timeout:.0f}s: {hung})" if hung else "")
                + ":\n"
                + "\n".join(errors)
            )
        return results


# --------------------------------------------------------------------------------------------
# training the tiny built-in model under several layouts, and comparing with one process
# --------------------------------------------------------------------------------------------

# The smallest built-in model and batch that still exercise every layout on two to four ranks:
# 8 sequences per step split into micro-batches of 2, so every data-parallel rank accumulates
# over at least two micro-batches.
TINY_CONFIG: dict[str, Any] = {
    "model": {"name": "llama", "size": "tiny"},
    "data": {"seq_len": 16},
    "train": {"global_batch_size": 8, "micro_batch_size": 2, "seed": 0, "device": "cpu"},
    "optimizer": {"warmup_steps": 0},
    "telemetry": {"enabled": False},
}
VOCAB_SIZE = 256  # the tiny preset is byte-level

# A plugin to register in every rank, by importable module path: "pkg.mod" (registered under its
# last dotted part) or ("name", "pkg.mod"). Paths rather than objects, because they cross into
# spawned ranks, where modules cannot be pickled.
PluginSpec = str | tuple[str, str]


@dataclass(frozen=True, slots=True)
class TrainTrace:
    """What one configuration produced, step by step (identical on every rank)."""

    losses: tuple[float, ...]
    grad_norms: tuple[float, ...]  # the global gradient norm before clipping, per step
    degrees: dict[str, int]


def merged_config(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """`TINY_CONFIG` with `overrides` merged in, table by table."""
    return _merge(TINY_CONFIG, overrides)


def _merge(base: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in overrides.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _plugin_pairs(plugins: Sequence[PluginSpec]) -> list[tuple[str, object]]:
    import importlib

    from plait.core.plugins import plugin_object

    pairs = []
    for spec in plugins:
        name, path = (spec.rsplit(".", 1)[-1], spec) if isinstance(spec, str) else spec
        pairs.append((name, plugin_object(importlib.import_module(path))))
    return pairs


def train_configs_on_rank(
    rank: int,
    world_size: int,
    configs: Mapping[str, Mapping[str, Any]],
    steps: int,
    plugins: Sequence[PluginSpec],
    autoload: bool,
) -> dict[str, TrainTrace]:
    """Rank function: train the tiny model under each config in turn, on the same ranks.

    Every rank feeds its data-parallel share of the same global batches, so any layout sees
    exactly the data one process would.
    """
    del rank, world_size
    import torch

    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    traces: dict[str, TrainTrace] = {}
    for name, overrides in configs.items():
        config = merged_config(overrides)
        train = config["train"]
        seq_len = config["data"]["seq_len"]
        tokens = torch.randint(
            0,
            VOCAB_SIZE,
            (steps, train["global_batch_size"], seq_len + 1),
            generator=torch.Generator().manual_seed(train["seed"]),
        )
        engine = Engine(
            config=config,
            plugins=Plugins.create(autoload=autoload, extra=_plugin_pairs(plugins)),
        )
        dp, dp_size = engine.mesh.coordinate("dp"), engine.mesh.size("dp")
        share = train["global_batch_size"] // dp_size
        losses, grad_norms = [], []
        for step in range(steps):
            batch = tokens[step, dp * share : (dp + 1) * share]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
            report = engine.last_report
            norm = None if report is None else report.grad_norm
            grad_norms.append(float("nan") if norm is None else norm)
        engine.close()
        traces[name] = TrainTrace(
            losses=tuple(losses), grad_norms=tuple(grad_norms), degrees=dict(engine.mesh.degrees)
        )
    return traces


def train_configs(
    configs: Mapping[str, Mapping[str, Any]],
    *,
    world_size: int,
    steps: int = 4,
    plugins: Sequence[PluginSpec] = (),
    autoload: bool = False,
    timeout: float = DEFAULT_TIMEOUT,
) -> dict[str, TrainTrace]:
    """Train the tiny model under each of `configs` (merged over `TINY_CONFIG`) on
    `world_size` Gloo ranks, all in one spawn; return each config's trace.

    `autoload=True` also loads the `plait` entry-point group in every rank (installed plugin
    packages); `plugins` are registered by module path either way.
    """
    ranks = run_distributed(
        train_configs_on_rank,
        world_size,
        dict(configs),
        steps,
        list(plugins),
        autoload,
        timeout=timeout,
    )
    for rank, traces in enumerate(ranks[1:], start=1):
        for name, trace in traces.items():
            if trace.losses != ranks[0][name].losses:
                raise AssertionError(
                    f"{name}: rank {rank} reports losses {trace.losses}, rank 0 "
                    f"{ranks[0][name].losses}; every rank must report the same mean loss"
                )
    return ranks[0]


@dataclass(frozen=True, slots=True)
class Comparison:
    """Losses (and gradient norms) of a layout against one process, step by step."""

    world_size: int
    reference: TrainTrace
    candidate: TrainTrace
    tolerance: float
    compare_gradients: bool

    @property
    def max_loss_difference(self) -> float:
        return _max_difference(self.reference.losses, self.candidate.losses)

    @property
    def max_grad_norm_difference(self) -> float:
        return _max_difference(self.reference.grad_norms, self.candidate.grad_norms)

    @property
    def ok(self) -> bool:
        if not self.max_loss_difference <= self.tolerance:
            return False
        return not self.compare_gradients or self.max_grad_norm_difference <= self.tolerance

    def __str__(self) -> str:
        degrees = " ".join(f"{axis}={n}" for axis, n in self.candidate.degrees.items())
        lines = [
            f"{self.world_size} ranks ({degrees}) against one process, tolerance "
            f"{self.tolerance:g}: {'ok' if self.ok else 'MISMATCH'}",
            f"{'step':>4}  {'loss, 1 process':>16}  {'loss, layout':>16}  {'difference':>10}"
            + (f"  {'grad norm difference':>20}" if self.compare_gradients else ""),
        ]
        rows = zip(
            self.reference.losses,
            self.candidate.losses,
            self.reference.grad_norms,
            self.candidate.grad_norms,
            strict=True,
        )
        for step, (ref, got, ref_norm, got_norm) in enumerate(rows):
            line = f"{step:>4}  {ref:>16.8f}  {got:>16.8f}  {abs(ref - got):>10.2e}"
            if self.compare_gradients:
                line += f"  {abs(ref_norm - got_norm):>20.2e}"
            lines.append(line)
        return "\n".join(lines)

    def assert_ok(self) -> None:
        """Raise an `AssertionError` carrying the step-by-step table unless `ok`."""
        if not self.ok:
            raise AssertionError(str(self))


def _max_difference(a: Sequence[float], b: Sequence[float]) -> float:
    import math

    differences = [abs(x - y) for x, y in zip(a, b, strict=True)]
    return math.inf if any(math.isnan(d) for d in differences) else max(differences, default=0.0)


def single_process_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """The reference for a layout: the same config without the `[parallel]` degrees and
    strategies (model transforms such as precision are kept) and without a pipelined schedule."""
    reference = {key: value for key, value in overrides.items() if key != "parallel"}
    transforms = dict(overrides.get("parallel", {})).get("transforms")
    if transforms:
        reference["parallel"] = {"transforms": transforms}
    if dict(overrides.get("parallel", {})).get("pp", 1) > 1:
        reference.pop("schedule", None)
    return reference


def compare_with_single_process(
    config_overrides: Mapping[str, Any],
    *,
    world_size: int = 2,
    steps: int = 4,
    extra_plugins: Sequence[PluginSpec] = (),
    autoload: bool = False,
    compare_gradients: bool = False,
    tolerance: float = 1e-5,
    timeout: float = DEFAULT_TIMEOUT,
) -> Comparison:
    """Train the tiny built-in model under `config_overrides` on `world_size` Gloo ranks and in
    one process, and compare the losses step by step (and, with `compare_gradients`, the global
    gradient norms before clipping, which no layout may change).

    Both runs see the same global batches. Call `.assert_ok()` on the result, or print it.
    """
    from concurrent.futures import ThreadPoolExecutor

    def train(overrides: Mapping[str, Any], ranks: int) -> TrainTrace:
        traces = train_configs(
            {"run": overrides},
            world_size=ranks,
            steps=steps,
            plugins=extra_plugins,
            autoload=autoload,
            timeout=timeout,
        )
        return traces["run"]

    # The two runs are independent jobs (separate rendezvous folders): start them together, so
    # the one process's start-up overlaps the ranks'.
    with ThreadPoolExecutor(max_workers=1) as pool:
        single = pool.submit(train, single_process_overrides(config_overrides), 1)
        candidate = train(config_overrides, world_size)
        reference = single.result()
    return Comparison(
        world_size=world_size,
        reference=reference,
        candidate=candidate,
        tolerance=tolerance,
        compare_gradients=compare_gradients,
    )
