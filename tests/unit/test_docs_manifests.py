"""The Kubernetes manifests in docs/ are valid YAML and every `plait` command line in them uses
options the CLI has (a renamed option must not leave the examples behind)."""

from __future__ import annotations

import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest
import typer.main

from plait.tools.cli import app

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = sorted((ROOT / "docs" / "kubernetes").glob("*.yaml"))


def _strings(node: object) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for value in node.values():
            yield from _strings(value)
    elif isinstance(node, list):
        if node and node[0] == "plait":  # an exec-form command: ["plait", "daemon", ...]
            yield shlex.join(node)
        for value in node:
            yield from _strings(value)


def _plait_commands(manifest: Path) -> list[list[str]]:
    commands = []
    for text in _strings(yaml.safe_load(manifest.read_text())):
        words = shlex.split(text)
        if len(words) > 1 and words[0] == "plait":
            commands.append(words[1:])
    return commands


def _options(subcommand: str) -> set[str]:
    group = typer.main.get_command(app)
    command = group.get_command(None, subcommand)  # type: ignore[attr-defined]
    assert command is not None, subcommand
    return {opt for param in command.params for opt in getattr(param, "opts", [])}


def test_there_are_manifests_for_a_job_and_the_daemon() -> None:
    names = {m.name for m in MANIFESTS}
    assert {"pytorchjob.yaml", "jobset.yaml", "daemonset.yaml"} <= names, names


@pytest.mark.parametrize("manifest", MANIFESTS, ids=lambda m: m.name)
def test_manifest_commands_use_real_options(manifest: Path) -> None:
    commands = _plait_commands(manifest)
    assert commands, f"{manifest.name} runs no plait command"
    for words in commands:
        known = _options(words[0])
        used = {w.split("=", 1)[0] for w in words[1:] if w.startswith("--")}
        assert used <= known, (manifest.name, sorted(used - known))
