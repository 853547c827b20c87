"""plait as a pip user gets it: the built wheel in a fresh virtualenv, run from an empty folder.

One venv serves every check (building it is the slow part). torch is the CPU build this
checkout's venv already holds, seen by the fresh venv through a `.pth` file naming a folder
outside it that holds torch's package and metadata only (links, not a copy of 900 MB): pip
counts it as installed, still resolves torch's own requirements, and, as the folder is outside
the environment, can never uninstall or overwrite it. Everything else the wheel declares pip
resolves from the index like any user's install (the newest pip, run from its wheel). Commands
run from an empty folder with nothing of the checkout on the path, so a missing dependency, a
config read from the repository or a module left out of the wheel fails here as it would for a
user.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import pytest

from tests.wheel_build import build_wheel

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # the CPU build this checkout's venv holds (linked, not copied)

HAND_WRITTEN = """\
[model]
name = "llama"
size = "tiny"

[data]
seq_len = 32

[train]
steps = 4
global_batch_size = 4
micro_batch_size = 2

[telemetry]
enabled = true
job_id = "handwritten"
"""


@dataclass(frozen=True)
class Installed:
    venv: Path
    work: Path  # an empty folder, the commands' working directory
    env: dict[str, str]

    @property
    def python(self) -> Path:
        return self.venv / "bin" / "python"

    def plait(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        """`plait ARGS` from the venv's script, stdout and stderr to files (not a terminal)."""
        out, err = self.work / "stdout.txt", self.work / "stderr.txt"
        with out.open("w") as stdout, err.open("w") as stderr:
            code = subprocess.run(
                [str(self.venv / "bin" / "plait"), *args],
                stdout=stdout, stderr=stderr, cwd=self.work, env=self.env, timeout=timeout,
            ).returncode  # fmt: skip
        result = subprocess.CompletedProcess(args, code, out.read_text(), err.read_text())
        out.unlink()
        err.unlink()
        return result


def _pip(python: Path, pip: Path, *args: str, cwd: Path) -> None:
    # Without byte-compiling (what a command imports is compiled as it is first imported):
    # about 25 s of the install on an idle 2-core machine, and nothing the checks read.
    subprocess.run(
        [str(python), str(pip / "pip"), "install", "--quiet", "--no-compile", *args],
        check=True, cwd=cwd, timeout=600, env=_clean_env(),
    )  # fmt: skip


def _clean_env() -> dict[str, str]:
    """The environment without this checkout or its venv: only the fresh venv is seen."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.pop("PLAIT_DISABLE_PLUGIN_AUTOLOAD", None)  # a user's default: entry points load
    env.pop("COLUMNS", None)
    return env


def _newest_pip(folder: Path) -> Path:
    """pip's newest wheel from the index (runnable as it is: `python pip.whl/pip`): it resolves
    plait's requirements faster than the pip `venv` bundles (23.2 here: 44 s against 24 to
    34 s on a 2-core machine, both without byte-compiling)."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
         ":all:", "-d", str(folder), "pip"],
        check=True, timeout=300, env=_clean_env(),
    )  # fmt: skip
    (wheel,) = folder.glob("pip-*.whl")
    return wheel


def _torch_beside(venv_site: Path, folder: Path) -> Path:
    """This venv's torch (`TORCH`) made visible to the fresh venv, read in place: `folder`,
    outside that venv, holds links to torch's top-level folders and its `.dist-info` only,
    and a `.pth` file in the fresh venv's site-packages names it. torch's requirements
    (sympy, jinja2, …) are not linked: pip installs them as torch's metadata asks."""
    torch = metadata.distribution("torch")
    assert torch.version.split("+")[0] == TORCH.split("==")[1], torch.version
    here = Path(torch.locate_file("")).resolve()
    tops = {file.parts[0] for file in torch.files or ()} - {".."}
    assert {"torch", f"torch-{torch.version}.dist-info"} <= tops, tops
    folder.mkdir()
    for name in sorted(tops):
        (folder / name).symlink_to(here / name)
    (venv_site / "torch-on-disk.pth").write_text(f"{folder}\n")
    return folder


@pytest.fixture(scope="module")
def installed() -> Iterator[Installed]:
    with tempfile.TemporaryDirectory(prefix="plait-wheel-") as folder:
        base = Path(folder)
        wheel = build_wheel(base)
        venv = base / "venv"
        # No pip of its own (ensurepip takes 6 s): the newest pip runs from its wheel instead.
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120
        )
        python = venv / "bin" / "python"
        site = _purelib(python)
        linked = _torch_beside(site, base / "torch-on-disk")
        pip = _newest_pip(base / "pip")
        # The rest from the index, as a user's `pip install plait` resolves it.
        _pip(python, pip, str(wheel), cwd=base)
        # pip kept the linked torch (an install of its own would land in the venv instead).
        assert not (site / "torch").exists(), "pip installed a torch of its own"
        work = base / "empty"
        work.mkdir()
        env = _clean_env()
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        env["HOME"] = str(base / "home")  # caches (the CPU calibration) of this user only
        torch_at = subprocess.run(
            [str(python), "-c", "import torch; print(torch.__file__)"],
            capture_output=True, text=True, check=True, cwd=work, env=env, timeout=120,
        ).stdout.strip()  # fmt: skip
        assert Path(torch_at).parent.parent == linked, torch_at
        yield Installed(venv, work, env)


def _purelib(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    out = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def _site_packages(installed: Installed) -> Path:
    return _purelib(installed.python)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_only_plait_lands_at_the_top_and_every_import_is_declared(installed: Installed) -> None:
    code = (
        "import importlib.metadata as m\n"
        "print(sorted({f.parts[0] for f in m.files('plait') if f.parts[0] != '..'}))"
    )
    out = subprocess.run(
        [str(installed.python), "-c", code],
        capture_output=True, text=True, check=True, cwd=installed.work, env=installed.env,
    )  # fmt: skip
    assert json.loads(out.stdout.replace("'", '"')) == ["plait", "plait-0.1.0.dist-info"]
    site = _site_packages(installed)
    for name in ("core", "plugins", "daemon", "proto", "tools", "planner", "configs"):
        assert not (site / name).exists() and not (site / f"{name}.py").exists()
    # The web page's assets are in the wheel: an offline node fetches nothing to draw it.
    static = site / "plait" / "daemon" / "web" / "static"
    for asset in ("index.html", "page.js", "page.css", "uPlot.iife.min.js", "uPlot.min.css"):
        assert (static / asset).stat().st_size > 0, asset
    # The installed files' imports against the installed metadata (the checker imports only
    # plait, from the venv).
    checker = installed.work.parent / "dependency_imports.py"
    shutil.copy(ROOT / "tests" / "dependency_imports.py", checker)
    result = subprocess.run(
        [str(installed.python), str(checker)],
        capture_output=True, text=True, cwd=installed.work, env=installed.env, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(
        r"checked \d{3,} imports under .*site-packages/plait: 0 problems", result.stdout
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_version_plugins_and_init_from_an_empty_folder(installed: Installed) -> None:
    version = installed.plait("--version")
    assert (version.returncode, version.stdout.strip()) == (0, "plait 0.1.0"), version
    plugins = installed.plait("plugins")
    assert plugins.returncode == 0, plugins.stdout + plugins.stderr
    for builtin in ("ddp", "zero", "pipeline", "kernels_torch", "kernels_triton", "telemetry"):
        # One line per plugin (stdout is a file: nothing wraps), naming where it comes from.
        assert re.search(rf"^│ {builtin} +│ plait \(built-in\) +│", plugins.stdout, re.M), (
            plugins.stdout
        )
    listed = installed.plait("plugins", "--json")
    assert {p["name"] for p in json.loads(listed.stdout)} >= {"ddp", "zero", "pipeline"}
    written = installed.plait("init", "tiny", "starter.toml")
    assert written.returncode == 0, written.stdout + written.stderr
    assert (installed.work / "starter.toml").is_file()
    valid = installed.plait("config", "validate", "starter.toml", "--nproc-per-node", "2")
    assert valid.returncode == 0 and "is valid on 2 ranks" in valid.stdout, valid
    (installed.work / "starter.toml").unlink()
    assert list(installed.work.iterdir()) == []


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_demo_runs_from_an_empty_folder(installed: Installed) -> None:
    demo = installed.plait("demo", "--steps", "6", timeout=400)
    assert demo.returncode == 0, demo.stdout + demo.stderr
    assert "node daemon on 127.0.0.1:" in demo.stdout
    assert "what the daemon saw" in demo.stdout and "bottleneck report" in demo.stdout
    assert re.search(r"^\W*demo\s.*\b2/2\b", demo.stdout, re.MULTILINE), demo.stdout


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.timeout(900)
def test_daemon_then_a_hand_written_config_on_two_ranks_then_status(
    installed: Installed,
) -> None:
    log = installed.work.parent / "daemon.log"
    with log.open("w") as out:
        daemon = subprocess.Popen(
            [str(installed.venv / "bin" / "plait"), "daemon", "--bind", "127.0.0.1:0",
             "--no-calibrate"],
            stdout=out, stderr=subprocess.STDOUT, cwd=installed.work, env=installed.env,
        )  # fmt: skip
    try:
        address = _listening_address(log, daemon)
        (installed.work / "mine.toml").write_text(HAND_WRITTEN)
        env_before = dict(installed.env)
        installed.env["PLAIT_DAEMON"] = address
        try:
            train = installed.plait("train", "mine.toml", "--nproc-per-node", "2", timeout=400)
        finally:
            installed.env.clear()
            installed.env.update(env_before)
        assert train.returncode == 0, train.stdout + train.stderr
        assert "2 ranks (pp=1 dp=2 cp=1 tp=1)" in train.stdout and "done: loss" in train.stdout
        # The job has finished: named, it is shown (unnamed, only with --all).
        status = installed.plait("status", "--host", address, "--json", "--job", "handwritten")
        assert status.returncode == 0, status.stdout + status.stderr
        document = json.loads(status.stdout)
        ranks = [r for r in document["ranks"] if r["job_id"] == "handwritten"]
        assert sorted(r["rank"] for r in ranks) == [0, 1], document
        table = installed.plait("status", "--host", address, "--all")
        assert table.returncode == 0 and "handwritten" in table.stdout, table
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0, log.read_text()
    assert "plait daemon stopped" in log.read_text()


def _listening_address(log: Path, daemon: subprocess.Popen[bytes]) -> str:
    """The address the daemon printed (it chose a free port); fails if it exits first."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        match = re.search(r"listening on (\S+:\d+)", log.read_text())
        if match:
            return match.group(1)
        assert daemon.poll() is None, log.read_text()
        time.sleep(0.2)
    raise AssertionError(f"the daemon never said where it listens:\n{log.read_text()}")
