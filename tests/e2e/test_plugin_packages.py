"""Three plugin distributions written only from docs/plugins.md, built and installed offline.

The int8 communication algorithm, the reverse-order accumulation schedule and the CPU kernel
provider are written out from docs/plugins.md's file blocks, built with the environment's setuptools
and installed with `pip --target` into a temporary folder on `PYTHONPATH` / `sys.path`, so the
virtualenv is never modified. A fourth, test-only distribution (a probe) records what a run's
hooks answered, so the test can tell that each plugin really ran.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from plait.testing.distributed import TrainTrace, train_configs
from tests.doc_blocks import write_files

ROOT = Path(__file__).resolve().parents[2]
PLAIT = [sys.executable, "-m", "plait.tools.cli"]
PACKAGES = {  # distribution -> (plugin name, what it registers)
    "plait-int8": (
        "int8",
        {"kind": "comm", "name": "int8", "ops": ["all_reduce", "reduce_scatter"]},
    ),
    "plait-reverse-accumulate": (
        "reverse_accumulate",
        {"kind": "schedule", "name": "reverse_accumulate"},
    ),
    "plait-cpu-kernels": (
        "cpu_kernels",
        {"kind": "kernel", "name": "rms_norm", "provider": "cpu_fused", "device_types": ["cpu"]},
    ),
}

PROBE_PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "plait-probe"
version = "0.1.0"

[project.entry-points.plait]
probe = "plait_probe"
"""

PROBE = '''\
"""Records what the schedule, kernel and communicate hooks answered; written at job end."""

import json
import math
import os
from pathlib import Path
from typing import Any

from plait import hookimpl
from plait.core.schedule import format_action


class Probe:
    def __init__(self):
        self.schedules, self.kernels, self.comm = [], {}, {}

    @hookimpl(wrapper=True)
    def plait_schedule(self, request):
        actions = yield
        self.schedules.append([format_action(action) for action in actions or ()])
        return actions

    @hookimpl(wrapper=True)
    def plait_kernel(self, name, device, dtype, provider):
        impl = yield
        if impl is not None:
            self.kernels[f"{name}/{device}/{dtype}"] = impl.__module__
        return impl

    @hookimpl(wrapper=True)
    def plait_communicate(self, request):
        key = f"{request.op} {request.purpose}"
        self.comm[key] = self.comm.get(key, 0) + 1
        return (yield)

    @hookimpl
    def plait_job_end(self):
        folder = os.environ.get("PLAIT_PROBE_DIR")
        if folder:
            seen = {"schedules": self.schedules, "kernels": self.kernels, "comm": self.comm}
            Path(folder, f"rank{os.environ['RANK']}.json").write_text(json.dumps(seen))


def make_plugin():
    return Probe()
'''


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    """This module's own temporary folder. NOTE: not pytest's numbered base folder, which a
    concurrent pytest session can clean up while the ranks here still read from it."""
    with tempfile.TemporaryDirectory(prefix="plait-plugin-packages-") as folder:
        yield Path(folder)


@pytest.fixture(scope="module")
def site(workdir: Path) -> Path:
    """docs/plugins.md's three distributions and the probe, installed in a folder of their own."""
    root = workdir
    sources = root / "src"
    for distribution in PACKAGES:
        written = write_files(sources, f"{distribution}/")
        assert written, f"docs/plugins.md has no {distribution} files"
    probe = sources / "plait-probe"
    probe.mkdir()
    (probe / "pyproject.toml").write_text(PROBE_PYPROJECT)
    (probe / "plait_probe.py").write_text(PROBE)
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--no-index", "--target", str(target),
         *(str(sources / name) for name in [*PACKAGES, "plait-probe"])],
        check=True, cwd=root, timeout=240,
    )  # fmt: skip
    return target


def _env(site: Path, **extra: str) -> dict[str, str]:
    """The environment of a `plait` command that loads the installed entry points."""
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_DISABLE_PLUGIN_AUTOLOAD"}
    env.update(PYTHONPATH=str(site), COLUMNS="250", **extra)
    return env


def _plait(args: list[str], env: dict[str, str], timeout: float) -> str:
    result = subprocess.run(
        [*PLAIT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.timeout(120)
def test_plait_plugins_lists_the_packages_with_their_distributions(
    site: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The command runs in this process (a CLI start-up costs seconds): the entry points are
    # found on sys.path, exactly as `PYTHONPATH` makes them visible to a `plait` process.
    from rich.console import Console
    from typer.testing import CliRunner

    from plait.tools import cli

    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("PLAIT_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    monkeypatch.setattr(cli, "console", Console(width=250))
    listed = CliRunner().invoke(cli.app, ["plugins", "--json"])
    assert listed.exit_code == 0, listed.output
    listing = {plugin["name"]: plugin for plugin in json.loads(listed.output)}
    for distribution, (plugin, provides) in PACKAGES.items():
        assert listing[plugin]["distribution"] == f"{distribution} 0.1.0"
        assert listing[plugin]["provides"] == [provides]
    assert listing["int8"]["hooks"] == [
        "plait_communicate",
        "plait_configure",
        "plait_job_end",
        "plait_register_comm_algorithms",
    ]
    table = CliRunner().invoke(cli.app, ["plugins"])
    assert table.exit_code == 0, table.output
    for distribution, (plugin, _) in PACKAGES.items():
        row = next(line for line in table.output.splitlines() if f" {plugin} " in line)
        assert f"{distribution} 0.1.0" in row, table.output


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_plait_train_selects_all_three_by_config(site: Path, workdir: Path) -> None:
    probe = workdir / "probe"
    probe.mkdir()
    stdout = _plait(
        ["train", "configs/tiny.toml", "--nproc-per-node", "2",
         "--set", "train.steps=3", "--set", "data.seq_len=32", "--set", "telemetry.enabled=false",
         "--set", "comm.algorithm=int8", "--set", "comm.int8.block_size=64",
         "--set", "schedule.name=reverse_accumulate",
         "--set", 'kernels.prefer=["cpu_fused"]'],
        _env(site, PLAIT_PROBE_DIR=str(probe)),
        timeout=280,
    )  # fmt: skip
    assert "schedule reverse_accumulate" in stdout and "done: loss" in stdout, stdout
    for rank in (0, 1):
        seen = json.loads((probe / f"rank{rank}.json").read_text())
        # 8 sequences over 2 ranks in micro-batches of 2: two micro-batches, the last one first.
        assert seen["schedules"] == [["F1", "B1", "F0", "B0", "sync", "step"]]
        assert seen["kernels"]["rms_norm/cpu/float32"] == "plait_cpu_kernels"
        assert seen["kernels"]["attention/cpu/float32"].startswith("plait.plugins.kernels_torch")
        # int8 took the gradient buckets over and carried them out as its own all-gathers.
        assert seen["comm"].get("all_gather int8/grad_bucket", 0) >= 3, seen["comm"]
        assert seen["comm"]["all_reduce grad_bucket"] == seen["comm"]["all_gather int8/grad_bucket"]


LAYOUTS = {
    "ddp": {"parallel": {"dp_strategy": "ddp"}},
    "zero1": {"parallel": {"dp_strategy": "zero1"}},
    "zero2": {"parallel": {"dp_strategy": "zero2"}},
    "zero3": {"parallel": {"dp_strategy": "zero3"}},
    # tp=2 leaves dp=1: four sequences make two micro-batches, so the two orders add the same
    # two gradients (exactly commutative) and any difference is the order logic, not rounding.
    "tp2": {"parallel": {"tp": 2}, "train": {"global_batch_size": 4}},
}
INT8 = {"algorithm": "int8", "int8": {"block_size": 64}}
EXAMPLES = {
    "my_dp": {"parallel": {"dp_strategy": "my_dp"}, "my_dp": {"average": True}},
    "int8": {"parallel": {"dp_strategy": "ddp"}, "comm": INT8},
    # ZeRO-2's reduce-scatter path (the GPU one), forced on Gloo: int8 takes it over too.
    "int8 reduce-scatter": {
        "parallel": {"dp_strategy": "zero2"},
        "zero": {"gradient_reduction": "reduce_scatter"},
        "comm": INT8,
    },
}


@pytest.fixture(scope="module")
def two_rank_traces(site: Path, workdir: Path) -> dict[str, TrainTrace]:
    """Every layout with each schedule order, and the docs' plugin examples, in one 2-rank spawn.

    The installed packages come in through the entry points (autoload on); the docs'
    strategy, which is not packaged, by module path.
    """
    strategy = workdir / "strategy"
    write_files(strategy, "my_package/")
    (strategy / "my_package" / "__init__.py").write_text("")
    cases: dict[str, dict[str, Any]] = dict(EXAMPLES)
    for layout, overrides in LAYOUTS.items():
        for schedule in ("accumulate", "reverse_accumulate"):
            cases[f"{layout} {schedule}"] = {**overrides, "schedule": {"name": schedule}}
    with pytest.MonkeyPatch.context() as patch:
        for folder in (site, strategy):  # spawned ranks start from this sys.path
            patch.syspath_prepend(str(folder))
        return train_configs(
            cases,
            world_size=2,
            steps=3,
            plugins=[("my_dp", "my_package.my_dp")],
            autoload=True,
            timeout=280,
        )


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_reverse_schedule_matches_the_default_order_under_every_layout(
    two_rank_traces: dict[str, TrainTrace],
) -> None:
    report, failed = [], []
    for layout in LAYOUTS:
        default = two_rank_traces[f"{layout} accumulate"]
        reverse = two_rank_traces[f"{layout} reverse_accumulate"]
        assert len(set(default.losses)) == len(default.losses), f"{layout}: the loss moves"
        difference = max(abs(a - b) for a, b in zip(default.losses, reverse.losses, strict=True))
        report.append(f"{layout}: {default.losses} vs {reverse.losses} ({difference:.1e})")
        if difference > 1e-6:
            failed.append(layout)
    assert not failed, f"reverse order changed the losses under {failed}:\n" + "\n".join(report)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_docs_strategy_and_int8_train_like_ddp(two_rank_traces: dict[str, TrainTrace]) -> None:
    reference = two_rank_traces["ddp accumulate"].losses
    my_dp = two_rank_traces["my_dp"].losses
    assert max(abs(a - b) for a, b in zip(my_dp, reference, strict=True)) <= 1e-6
    for name in ("int8", "int8 reduce-scatter"):
        trace = two_rank_traces[name]
        difference = max(abs(a - b) for a, b in zip(trace.losses, reference, strict=True))
        assert 0 < difference < 2e-2, f"{name} takes the buckets over, stays close: {difference}"
        assert all(math.isfinite(norm) for norm in trace.grad_norms)


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_the_docs_test_suite_passes_in_the_package(site: Path, workdir: Path) -> None:
    package = workdir / "suite" / "plait-reverse-accumulate"
    write_files(workdir / "suite", "plait-reverse-accumulate/")
    (package / "plait_reverse_accumulate.py").unlink()  # tests run against the installed copy
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        capture_output=True, text=True, timeout=280, cwd=package, env=_env(site),
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout, result.stdout
