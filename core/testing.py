"""Helpers for tests of plait and of plait plugins: run a function on several Gloo ranks.

Ranks rendezvous through a `FileStore` in a temporary directory, so tests never need a network
port and cannot collide with each other. Every run has a timeout: a hung rank fails the test
with the ranks that did not finish instead of stalling the suite.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

DEFAULT_TIMEOUT = 180.0


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
        outcome = ("ok", fn(rank, world_size, *args))
    except BaseException as exc:
        outcome = ("error", f"rank {rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
    finally:
        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    with open(Path(result_dir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(outcome, f)


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned Gloo ranks; return each result.

    `fn` must be importable (a module-level function). Results must be picklable.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="plait-ranks-") as tmp:
        store_path = str(Path(tmp) / "store")
        base_env = {"PLAIT_DISABLE_PLUGIN_AUTOLOAD": "1", "OMP_NUM_THREADS": "1"}
        base_env.update(env or {})
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
