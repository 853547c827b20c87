"""The published telemetry schema: documented in docs/telemetry-schema.md, dependency-free, used by
both sides."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from plait.daemon import telemetry_schema as schema
from plait.daemon.exporters import KNOWN_POINTS, prometheus_name

ROOT = Path(__file__).resolve().parents[2]


def schema_section() -> str:
    """The schema's page: its tables are the published schema."""
    return (ROOT / "docs" / "telemetry-schema.md").read_text()


def schema_constants() -> dict[str, str]:
    return {
        name: value
        for name, value in vars(schema).items()
        if name.isupper() and isinstance(value, str)
    }


def test_every_schema_constant_is_in_the_docs_tables() -> None:
    section = schema_section()
    missing = []
    for name, value in schema_constants().items():
        # A prefix is documented with its placeholder: `plait.mesh.coord.<axis>`.
        written = f"`{value}<" if value.endswith(".") else f"`{value}`"
        if written not in section:
            missing.append(f"{name} = {value!r}")
    assert not missing, f"docs/telemetry-schema.md lacks: {missing}"
    assert len(schema_constants()) > 50


def test_every_published_metric_and_its_prometheus_name_is_in_the_docs() -> None:
    section = schema_section()
    for name, (counter, unit) in KNOWN_POINTS.items():
        prometheus = prometheus_name(name, unit, counter) + ("_total" if counter else "")
        assert re.search(rf"\| `{re.escape(name)}` \| `{prometheus}` \|", section), name


def test_the_schema_module_imports_nothing_but_the_standard_library() -> None:
    tree = ast.parse(Path(schema.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        (node.module or "").split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
    }
    assert imported <= {"__future__", "collections", "typing"}, imported


def test_the_emitter_uses_the_schema_names() -> None:
    """No wire name is spelled out as a literal in the rank-side emitter or the decoder."""
    values = {
        v for v in schema_constants().values() if v.startswith(("plait.", "host.", "process."))
    }
    emitters = sorted(
        p.relative_to(ROOT).as_posix() for p in (ROOT / "plugins/telemetry").glob("*.py")
    )
    for path in ("daemon/telemetry_resource.py", *emitters, "daemon/decoder.py"):
        literals = {
            node.value
            for node in ast.walk(ast.parse((ROOT / path).read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
        }
        assert not (literals & values), (path, literals & values)


def test_prometheus_names_follow_the_conventions() -> None:
    assert prometheus_name("plait.rank.step.duration", "s") == "plait_rank_step_duration_seconds"
    assert prometheus_name("plait.rank.bottleneck.seconds", "s") == "plait_rank_bottleneck_seconds"
    assert prometheus_name("plait.job.mfu", "1") == "plait_job_mfu_ratio"
    assert prometheus_name("hw.gpu.memory.usage", "By") == "hw_gpu_memory_usage_bytes"
    assert prometheus_name("hw.energy", "J", counter=True) == "hw_energy_joules"  # + _total
    assert prometheus_name("plait.rank.tokens_per_second", "{token}/s") == (
        "plait_rank_tokens_per_second"
    )
    assert prometheus_name("plait.gpu.pcie.throughput", "By/s") == (
        "plait_gpu_pcie_throughput_bytes_per_second"
    )
