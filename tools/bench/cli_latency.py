"""How long `plait top --once --json` and `plait status --json` take against one idle daemon.

    python tools/bench/cli_latency.py [--runs 10] [--bytecode] [--busy 0] [--host HOST:PORT]

An idle daemon is started (`plait daemon --bind 127.0.0.1:0 --no-calibrate`; `--host` asks an
already running one instead), then each command runs `--runs` times as a process of its own,
the commands in turn so that a change of the machine's load falls on all of them alike, each
timed from start to exit (what an operator polling it, or a script calling it in a loop, waits).
Printed per command: the median and the 90th percentile of those runs, the median CPU time
(user + system) of a run, which a busy machine inflates less than the wall time, and what of
the median is imports: after each run, the modules a run of the command loads are imported
again, in the same order, in a fresh interpreter that does nothing else, and timed inside it
(median of `--runs`); the interpreter's own start (`python -c pass`) is printed beside it. What
is left is typer's parsing, the channel, the calls, the printing and the interpreter's exit.

Where `PYTHONDONTWRITEBYTECODE` is set, as in some development shells, every run compiles each
of plait's modules it imports from source; `--bytecode` runs the commands with bytecode written
to and read from a temporary cache (`PYTHONPYCACHEPREFIX`, after one warm-up run), as an
installed wheel's are.

`--busy N` keeps N processes spinning on the CPU meanwhile, stand-ins for a training job's ranks
(each keeps a core busy). Run it with 0 and with the number of cores to compare.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.table import Table

COMMANDS: dict[str, tuple[str, ...]] = {
    "top --once --json": ("top", "--once", "--json"),
    "status --json": ("status", "--json"),
}
DAEMON_START_TIMEOUT_SECONDS = 60.0

# Runs `plait` as its console script does (`plait.tools.cli:main`) and writes, at exit, the
# names of the modules it loaded, in the order they were loaded.
RECORD_MODULES = """
import atexit, sys
listing = sys.argv[1]
def _record():
    with open(listing, "w") as out:
        out.write("\\n".join(sys.modules))
atexit.register(_record)
sys.argv = ["plait", *sys.argv[2:]]
from plait.tools.cli import main
main()
"""

# Imports the listed modules in order and prints the seconds it took.
IMPORT_ONLY = """
import importlib, sys, time
names = open(sys.argv[1]).read().split()
start = time.perf_counter()
for name in names:
    if name in sys.modules or name == "__main__":
        continue
    try:
        importlib.import_module(name)
    except Exception:
        pass  # a module that only exists as another's attribute or alias
print(time.perf_counter() - start)
"""

SPIN = "while True: pass"


def plait_command() -> list[str]:
    """The `plait` console script beside this interpreter (what an operator runs)."""
    script = Path(sys.executable).with_name("plait")
    return [str(script)] if script.exists() else [sys.executable, "-m", "plait.tools.cli"]


def command_environment(bytecode_cache: Path | None) -> dict[str, str]:
    """This process's environment, with bytecode written to `bytecode_cache` when given."""
    env = dict(os.environ)
    if bytecode_cache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(bytecode_cache)
    return env


@contextmanager
def idle_daemon() -> Iterator[str]:
    """A daemon with no job, on a free loopback port; yields its address."""
    process = subprocess.Popen(
        [*plait_command(), "daemon", "--bind", "127.0.0.1:0", "--no-calibrate"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + DAEMON_START_TIMEOUT_SECONDS
        seen = ""
        assert process.stdout is not None
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            if not line:
                break
            seen += line
            found = re.search(r"listening on (\S+)", line)
            if found:
                yield found.group(1)
                return
        raise RuntimeError(f"the daemon did not start:\n{seen}")
    finally:
        process.terminate()
        process.wait(timeout=30)


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def timed_run(argv: Sequence[str], env: Mapping[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one run of `argv` to its exit."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def percentile(values: Sequence[float], fraction: float) -> float:
    """The nearest-rank percentile (`fraction` 0.9: the value 90 % of the runs are at or under)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def record_modules(args: Sequence[str], listing: Path, env: Mapping[str, str]) -> None:
    """Writes to `listing` the modules one run of `plait ARGS` loads, in their order."""
    subprocess.run(
        [sys.executable, "-c", RECORD_MODULES, str(listing), *args],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )


def import_seconds(listing: Path, env: Mapping[str, str]) -> float:
    """Seconds a fresh interpreter takes to import the modules of `listing`."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORT_ONLY, str(listing)],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    )
    return float(done.stdout)


def measure(host: str, runs: int, env: Mapping[str, str], folder: Path) -> Table:
    commands = {name: [*plait_command(), *args, "--host", host] for name, args in COMMANDS.items()}
    listings = {name: folder / f"modules-{i}.txt" for i, name in enumerate(COMMANDS)}
    for name, argv in commands.items():
        timed_run(argv, env)  # warm-up: fills the bytecode cache when there is one
        record_modules(argv[len(plait_command()) :], listings[name], env)
    walls: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpus: dict[str, list[float]] = {name: [] for name in COMMANDS}
    imports: dict[str, list[float]] = {name: [] for name in COMMANDS}
    starts = []
    bare = [sys.executable, "-c", "pass"]
    for _ in range(runs):
        # Each command's run and its imports alone back to back: both under the same load.
        for name, argv in commands.items():
            wall, cpu = timed_run(argv, env)
            walls[name].append(wall)
            cpus[name].append(cpu)
            imports[name].append(import_seconds(listings[name], env))
        starts.append(timed_run(bare, env)[0])
    table = Table(title=f"`plait …` against an idle daemon, {runs} runs each, seconds")
    headers = ("command", "median", "p90", "CPU", "imports", "import share", "interpreter")
    for column in headers:
        table.add_column(column, justify="left" if column == "command" else "right")
    for name in COMMANDS:
        median = statistics.median(walls[name])
        imported = statistics.median(imports[name])
        table.add_row(
            name,
            f"{median:.3f}",
            f"{percentile(walls[name], 0.9):.3f}",
            f"{statistics.median(cpus[name]):.3f}",
            f"{imported:.3f}",
            f"{imported / median:.0%}",
            f"{statistics.median(starts):.3f}",
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="runs of each command")
    parser.add_argument(
        "--bytecode", action="store_true", help="cache bytecode as an installed wheel does"
    )
    parser.add_argument(
        "--busy", type=int, default=0, help="processes spinning on the CPU meanwhile"
    )
    parser.add_argument("--host", default="", help="an already running daemon (HOST:PORT)")
    args = parser.parse_args()
    console = Console(width=max(Console().width, 100))
    with tempfile.TemporaryDirectory() as folder, busy_processes(args.busy):
        env = command_environment(Path(folder) / "bytecode" if args.bytecode else None)
        if args.host:
            table = measure(args.host, args.runs, env, Path(folder))
        else:
            with idle_daemon() as host:
                table = measure(host, args.runs, env, Path(folder))
    console.print(table)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    compiled = "cached" if "PYTHONDONTWRITEBYTECODE" not in env else "compiled every run"
    console.print(
        f"{args.busy} spinning processes; load average {load}; plait's bytecode {compiled}",
        highlight=False,
    )


if __name__ == "__main__":
    main()
