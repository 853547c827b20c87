"""`plait --help` and `plait status` start fast: command modules that load gRPC, the daemon,
torch or numpy are imported only when one of their commands runs, and a client command
(`top --once --json`, polled by operators and scripts) imports none of the daemon's server
side nor any other command's module."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from plait.tools.cli import LAZY_MODULES, app, command_help_from_source

HEAVY = ("torch", "grpc", "numpy", "plait.daemon.service", "opentelemetry.sdk")
# The daemon's server side (its servicer, store, analysis, exporters, decoder, ingest, host
# sampling) and what only other commands load: the training stack, pictures, the live screen,
# the control channel's client (asked only about a hung collective) and the other command
# groups. A client command answers from the daemon's messages without any of it.
NOT_FOR_CLIENTS = (
    "plait.daemon.service",
    "plait.daemon.server",
    "plait.daemon.analysis",
    "plait.daemon.exporters",
    "plait.daemon.store",
    "plait.daemon.decoder",
    "plait.daemon.ingest_pool",
    "plait.daemon.host",
    "prometheus_client",
    "opentelemetry.sdk",
    "torch",
    "numpy",
    "matplotlib",
    "rich.live",
    "plait.tools.daemon_pictures",
    "plait.tools.profile_commands",
    "plait.tools.data_commands",
    "plait.tools.schedule_commands",
    "plait.tools.kernels_commands",
    "plait.tools.ckpt_commands",
    "plait.tools.plan_commands",
)
# Runs `plait ARGS` as the console script does and writes the modules it loaded to a file.
CLIENT_PROBE = """
import atexit, json, sys
listing, args = sys.argv[1], sys.argv[2:]
atexit.register(lambda: open(listing, "w").write(json.dumps(sorted(sys.modules))))
sys.argv = ["plait", *args]
from plait.tools.cli import main
main()
"""
UNREACHABLE = "127.0.0.1:1"  # refuses at once: the command runs its whole path, then exits 1


def test_help_imports_no_heavy_module_and_lists_every_command() -> None:
    probe = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from plait.tools.cli import app\n"
        "result = CliRunner().invoke(app, ['--help'], env={'COLUMNS': '200'})\n"
        "assert result.exit_code == 0, result.output\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
        "print(result.output)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    loaded, _, help_text = result.stdout.partition("\n")
    assert loaded == "[]", f"plait --help imported {loaded}"
    for command in ("train", "plugins", "data", "ckpt", "status", "top", "bottleneck", "daemon"):
        assert f"│ {command} " in help_text, help_text
    assert "Show each daemon's state" in help_text  # help read from the lazy module's source


def test_lazy_commands_listed_from_source_match_the_module() -> None:
    import importlib

    for module_name in LAZY_MODULES:
        listed = command_help_from_source(module_name)
        group = typer.main.get_group(importlib.import_module(module_name).app)
        real = {
            name: (command.help or "").strip().split("\n\n")[0].replace("\n", " ")
            for name, command in group.commands.items()
            if not command.hidden
        }
        assert listed == real


def test_a_lazy_command_runs_through_the_top_level_app() -> None:
    result = CliRunner().invoke(app, ["status", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "Usage: plait status" in result.output and "--json" in result.output
    unknown = CliRunner().invoke(app, ["stauts"])
    assert unknown.exit_code == 2 and "No such command" in unknown.output


def test_source_listing_follows_typers_naming_rules(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stranger_commands.py").write_text(
        "import typer\n"
        "app = typer.Typer()\n"
        "@app.command()\n"
        "def show_jobs():\n"
        '    """List the jobs.\n\n    More text."""\n'
        '@app.command("kill")\n'
        "def _kill():\n"
        '    """Stop a job."""\n'
        '@app.command(name="pause", help="Pause a job.")\n'
        "def pause_it():\n"
        '    """Not this."""\n'
        "@app.command(hidden=True)\n"
        "def secret():\n"
        "    pass\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    listed = command_help_from_source("stranger_commands")
    assert listed == {"show-jobs": "List the jobs.", "kill": "Stop a job.", "pause": "Pause a job."}
    import importlib

    group = typer.main.get_group(importlib.import_module("stranger_commands").app)
    assert sorted(listed) == sorted(n for n, c in group.commands.items() if not c.hidden)


@pytest.mark.parametrize(
    ("args", "also_not"),
    [
        (("top", "--once", "--json"), ("plait.daemon.bottleneck",)),
        (("status", "--json"), ("plait.daemon.bottleneck",)),
        (("bottleneck", "--json"), ()),
    ],
    ids=["top", "status", "bottleneck"],
)
def test_client_commands_import_no_server_side(
    tmp_path: Path, args: tuple[str, ...], also_not: tuple[str, ...]
) -> None:
    """What a client command imports, listed by the process itself (never timed: the suite
    runs on busy machines); `top` and `status` also leave the bottleneck analysis alone."""
    listing = tmp_path / "modules.json"
    result = subprocess.run(
        [sys.executable, "-c", CLIENT_PROBE, str(listing), *args, "--host", UNREACHABLE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1, result.stderr  # the unreachable host, reported
    document = json.loads(result.stdout)
    assert document["command"] == args[0] and "UNAVAILABLE" in result.stdout, result.stdout
    loaded = set(json.loads(listing.read_text()))
    assert "plait.tools.daemon_commands" in loaded  # the probe ran the command
    imported = [m for m in (*NOT_FOR_CLIENTS, *also_not) if m in loaded]
    assert imported == [], f"plait {' '.join(args)} imported {imported}"
