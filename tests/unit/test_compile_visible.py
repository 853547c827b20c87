"""What the compile transform did, made visible: the dry run names the compiled blocks, and the
watch's lines count graphs, graph breaks with Dynamo's reasons, and recompilations with theirs."""

from __future__ import annotations

import io
import logging
from collections import Counter
from typing import Any

import pytest
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
from plait.tools.kernels_commands import compiled_forms
from tests.unit.triton_interpreter import interpreted_only

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
    assert "inside each block" not in line  # nothing runs eagerly inside a ZeRO-3 block
    tensor_parallel = _dry_run(
        parallel={"tp": 2, "transforms": {"compile": "compile"}}, tp={"sequence_parallel": True}
    )
    line = next(ln for ln in tensor_parallel.splitlines() if ln.startswith("compiled blocks:"))
    assert line.endswith(
        "inside each block, the tensor-parallel collectives (parallel.tp = 2) run eagerly "
        "between its compiled pieces, a graph break at each"
    ), line


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


def _first_summary(**sections: Any) -> str:
    """The compile watch's first line for two steps of the tiny Llama with compiled blocks."""
    import torch

    from plait.core.engine import Engine

    torch._dynamo.reset()
    config = {
        **TINY,
        "model": {"name": "llama", "size": "tiny", "overrides": {"n_layers": 1}},
        "train": {"device": "cpu", "global_batch_size": 2, "seed": 0},
        "data": {"seq_len": 16},
        "parallel": {"transforms": {"compile": "compile"}},
        "compile": {"backend": "eager"},
        **sections,
    }
    engine = Engine(config=config, plugins=Plugins.create(autoload=False))
    tokens = torch.randint(
        0, engine.model_config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)
    )
    for _ in range(2):
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
    watch = engine.plugins.manager.get_plugin("compile.watch")
    engine.close()
    return watch.summaries[0]


@pytest.mark.triton
@interpreted_only
def test_the_summary_names_the_plait_kernels_the_graphs_kept_as_custom_ops() -> None:
    """Triton's kernels under the compiler are `torch.ops.plait.*` nodes; the torch reference
    is traced into aten ops, and the line says nothing of custom ops."""
    # The optimizer and the loss on the torch reference: the interpreter runs the blocks only.
    plain = {"adamw_step": "torch", "softmax_cross_entropy": "torch"}
    triton = _first_summary(kernels={"prefer": ["triton", "torch"], "overrides": plain})
    kept = triton.partition("plait kernels as custom ops in the graphs: ")[2]
    assert {part.split(" ×")[0] for part in kept.split(", ")} == {
        "attention",
        "rms_norm",
        "rope",
        "swiglu",
    }, triton
    assert "custom ops" not in _first_summary(kernels={"prefer": ["torch"]})
    # What `plait kernels` says of them ahead of any compile agrees.
    forms = compiled_forms()
    assert all(forms[(op, "triton")] == "custom op" for op in ("attention", "rms_norm", "rope"))
