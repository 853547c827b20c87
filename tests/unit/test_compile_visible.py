"""What the compile transform did, made visible: the dry run names the compiled blocks, and the
watch's lines count graphs, graph breaks with Dynamo's reasons, and recompilations with theirs."""

from __future__ import annotations

import io
import logging
from collections import Counter
from typing import Any

from rich.console import Console

from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.plugins.compile.watch import (
    CompileCounts,
    CompileWatch,
    first_step_summary,
    recompile_summary,
)
from plait.tools.dry_run import print_dry_run

TINY = {"model": {"name": "llama", "size": "tiny"}, "telemetry": {"enabled": False}}


def _dry_run(**sections: dict) -> str:
    out = io.StringIO()
    print_dry_run(
        load_config({**TINY, **sections}),
        Plugins.create(autoload=False),
        world_size=2,
        per_node=2,
        console=Console(file=out, width=400),
    )
    return out.getvalue()


def test_the_dry_run_says_the_blocks_are_compiled_and_how() -> None:
    compiled = _dry_run(
        parallel={"dp_strategy": "zero3", "transforms": {"compile": "compile"}},
        compile={"backend": "aot_eager"},
    )
    line = next(ln for ln in compiled.splitlines() if ln.startswith("compiled blocks:"))
    assert "forward of each of the 2 blocks in layers" in line, line
    assert "backend aot_eager" in line and "run eagerly" in line, line
    assert "compiled blocks" not in _dry_run(parallel={"dp_strategy": "zero3"})


def _counts(
    graphs: int, breaks: dict[str, int], reasons: tuple[str, ...], s: float
) -> CompileCounts:
    return CompileCounts(graphs, Counter(breaks), reasons, s)


def test_counts_since_an_earlier_moment_are_what_changed() -> None:
    earlier = _counts(2, {"a": 1}, ("0/0: old",), 1.0)
    later = _counts(5, {"a": 3, "b": 1}, ("0/0: old", "0/1: new"), 4.5)
    change = later.since(earlier)
    assert change == _counts(3, {"a": 2, "b": 1}, ("0/1: new",), 3.5)


def test_the_summary_names_graphs_breaks_with_reasons_and_compile_time() -> None:
    clean = first_step_summary(_counts(1, {}, (), 2.04), blocks=6)
    assert (
        clean == "compiled blocks: 1 graph for 6 blocks, 0 graph breaks, 2.0 s compiling by step 1"
    )
    broken = first_step_summary(
        _counts(3, {"Unsupported method call\n  Explanation: Work.wait": 2}, (), 1.0),
        blocks=2,
        step=2,
    )
    assert "3 graphs for 2 blocks, 2 graph breaks" in broken and "by step 2" in broken
    assert broken.endswith("(breaks: 2× Unsupported method call)"), broken


def test_a_recompilation_is_named_with_its_guard_failure() -> None:
    line = recompile_summary(
        _counts(
            1,
            {},
            ("0/1: tensor 'x' size mismatch at index 1. expected 16, actual 8\nUser stack",),
            0.3,
        ),
        step=7,
    )
    assert line == (
        "compiled blocks recompiled in step 7: 0/1: tensor 'x' size mismatch at index 1. "
        "expected 16, actual 8"
    )


def test_rank_0_logs_the_summary_once_and_other_ranks_stay_quiet(caplog: Any) -> None:
    import torch

    torch._dynamo.reset()
    watches = [CompileWatch(blocks=1, rank=rank) for rank in (0, 1)]
    layer = torch.nn.Linear(4, 4)
    layer.forward = torch.compile(layer.forward, backend="eager")
    with caplog.at_level(logging.WARNING, logger="plait.compile"):
        for _ in range(3):  # three steps of one shape: compiled once, logged once
            layer(torch.randn(2, 4))
            for watch in watches:
                watch.plait_step_end(None)  # type: ignore[arg-type]
    logged = [r.getMessage() for r in caplog.records if r.name == "plait.compile"]
    assert logged == watches[0].summaries == watches[1].summaries
    assert len(logged) == 1 and logged[0].startswith("compiled blocks: 1 graph for 1 block,")
