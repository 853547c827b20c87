"""Consecutive 2-rank training runs with checkpoints, each ending in a real interpreter exit.

`python -m tests.e2e.clean_exit_runs RUNS ROOT` runs RUNS jobs one after another and prints one
line per run with its ranks' exit codes; it exits 0 only if every rank of every run did.

Each rank is what a user's script is under torchrun: `Engine` + `Checkpointer` on the tiny
Llama, a few steps with a save every two, then the end of the script — `sys.exit`, so Python
runs its whole shutdown (atexit handlers, thread joins, finalization), where a C++ thread left
running aborts the process. Even runs close the engine; odd ones leave it open, as the
docs' examples do; every second pair saves in the background, and every fifth run keeps
the default telemetry with no daemon running.

To pay for `import torch` once instead of 2 × RUNS times, the launcher imports everything and
forks each rank (the ranks still set up distributed from scratch, as torchrun's workers do:
env:// against a store hosted outside them, one key space per run via
TORCHELASTIC_RESTART_COUNT). A rank's script ends with an `atexit` check registered before the
engine exists, so it runs after plait's own exit handlers: any Gloo worker thread or plait
background thread still alive then would outlive the interpreter, and the rank exits with
`LEFTOVER_THREADS` — the abort is a race, the leftover thread is not.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch.distributed as dist

from plait.core.engine import Engine
from plait.core.plugins import BUILTIN_PLUGINS
from plait.core.process_groups import gloo_worker_threads
from plait.plugins.checkpoint.checkpointer import Checkpointer
from plait.plugins.checkpoint.config import CheckpointIOConfig
from tests.dist.checkpoint_workers import engine_batches, engine_config
from tests.free_ports import refused_port

WORLD_SIZE = 2
STEPS, EVERY = 3, 2
RUN_TIMEOUT_SECONDS = 150.0
LEFTOVER_THREADS = 3  # a rank's exit code when a thread would outlive the interpreter
PLAIT_THREADS = ("plait-collective-progress", "plait-span-export")


def rank_script(run: int, rank: int, port: int, no_daemon_port: int, root: Path) -> int:
    """One rank's script; returns the exit code it asks for."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(WORLD_SIZE),
        LOCAL_WORLD_SIZE=str(WORLD_SIZE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is the launcher's, as under torchrun
        TORCHELASTIC_RESTART_COUNT=str(run),  # plait keys each attempt apart in the store
    )
    atexit.register(_fail_on_leftover_threads, rank)
    config = engine_config()
    config["train"]["steps"] = STEPS
    if run % 5 == 4:  # telemetry on, as by default, with no daemon to talk to
        config["telemetry"] = {"daemon": f"127.0.0.1:{no_daemon_port}"}
    engine = Engine(config=config)
    batches = engine_batches(engine)
    checkpointer = Checkpointer(
        engine,
        batches,
        CheckpointIOConfig(dir=str(root / f"run-{run}"), every=EVERY, async_save=run % 4 >= 2),
    )
    for step in range(checkpointer.maybe_resume(), STEPS):
        engine.train_step(batches.next_batch())
        checkpointer.maybe_save(step + 1)
    checkpointer.close()
    if run % 2 == 0:
        engine.close()
    return 0


def _fail_on_leftover_threads(rank: int) -> None:
    threads = [t.name for t in threading.enumerate() if t.name in PLAIT_THREADS and t.is_alive()]
    gloo = gloo_worker_threads()
    if threads or gloo:
        print(
            f"rank {rank}: at exit {gloo} Gloo worker thread(s) and {threads} still run",
            file=sys.stderr,
            flush=True,
        )
        sys.stderr.flush()
        os._exit(LEFTOVER_THREADS)


def _output_to(path: Path) -> None:
    """Send this process's stdout and stderr (Python's and C++'s) to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _host_store() -> tuple[int, int, int]:
    """A TCPStore in a process of its own (a forked rank must not inherit a store server);
    returns (its pid, its port, the pipe end whose closing ends it). It also ends when the
    launcher dies, however it dies: the pipe then reads end-of-file."""
    port_read, port_write = os.pipe()
    life_read, life_write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(port_read)
        os.close(life_write)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        os.write(port_write, f"{store.port}\n".encode())
        os.close(port_write)
        while os.read(life_read, 1):  # until every holder of the other end is gone
            pass
        os._exit(0)
    os.close(port_write)
    os.close(life_read)
    with os.fdopen(port_read) as pipe:
        return pid, int(pipe.readline()), life_write


def _wait(pids: list[int], timeout: float) -> list[int | None]:
    """Each child's exit code (negative: killed by that signal); None if it timed out."""
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + timeout
    while len(codes) < len(pids) and time.monotonic() < deadline:
        for pid in pids:
            if pid not in codes:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[pid] = os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    for pid in pids:
        if pid not in codes:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[pid] = None
    return [codes[pid] for pid in pids]


def _preload() -> None:
    """Import what building an engine imports, once, before the ranks are forked, and freeze
    it: the ranks' collector (and their final collection at exit) then skip the millions of
    objects of torch's modules, which would cost each rank seconds on a busy machine (the
    frozen objects still go away with the process; the exit path is otherwise unchanged)."""
    for _, module in BUILTIN_PLUGINS:
        importlib.import_module(module)
    gc.collect()
    gc.freeze()


def main(runs: int, root: Path) -> int:
    root.mkdir(parents=True, exist_ok=True)
    _preload()
    with refused_port() as no_daemon_port:
        return _runs(runs, root, no_daemon_port)


def _runs(runs: int, root: Path, no_daemon_port: int) -> int:
    store_pid, port, store_life = _host_store()
    failed = 0
    for run in range(runs):
        sys.stdout.flush()
        sys.stderr.flush()
        pids, logs = [], []
        for rank in range(WORLD_SIZE):
            logs.append(root / f"run-{run}-rank{rank}.log")
            pid = os.fork()
            if pid == 0:
                os.close(store_life)  # the store's life is the launcher's, not a rank's
                _output_to(logs[-1])
                # The rank's script ends here: SystemExit unwinds to the top and Python exits.
                raise SystemExit(rank_script(run, rank, port, no_daemon_port, root))
            pids.append(pid)
        codes = _wait(pids, RUN_TIMEOUT_SECONDS)
        print(f"run {run} exit codes {codes}", flush=True)
        if any(code != 0 for code in codes):
            failed += 1
            for log in logs:
                print(f"--- {log.name}\n{log.read_text()}", flush=True)
    os.close(store_life)
    os.waitpid(store_pid, 0)
    gc.unfreeze()  # the launcher's own exit frees its objects (else extensions report leaks)
    print(f"{runs - failed} of {runs} runs exited 0", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), Path(sys.argv[2])))
