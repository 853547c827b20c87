"""Which parallel layouts the compile transform takes: tensor, context and expert parallelism
compile (each runs something eagerly inside every block, a graph break at each), also with
activation checkpointing (the block compiled inside its checkpoint wrapper); with
`compile.fullgraph = true` each is refused, saying why — every break would be an error. The
training itself is in tests/dist/test_compile_tp.py, test_compile_cp.py and test_compile_ep.py."""

from __future__ import annotations

import pytest

from plait.core.config import PlaitConfig
from plait.core.errors import ConfigError
from plait.plugins import compile

AXES = {"tp": {"tp": 2}, "cp": {"cp": 2, "cp_strategy": "ring"}, "ep": {"ep": 2}}


def _config(axis: str, transforms: dict[str, str], **sections: dict) -> PlaitConfig:
    parallel = {**AXES[axis], "transforms": {"compile": compile.NAME, **transforms}}
    return PlaitConfig.model_validate({"parallel": parallel, **sections})


@pytest.mark.parametrize("axis", AXES)
@pytest.mark.parametrize("transforms", [{}, {"ac": "checkpoint"}], ids=["alone", "ac"])
def test_layouts_with_a_break_in_every_block_compile(axis: str, transforms: dict) -> None:
    config = _config(axis, transforms)
    compile._refuse_untested_layouts(config)
    assert compile.breaks_between_pieces(config)


def test_a_layout_without_one_compiles_the_checkpoint_wrapper_whole() -> None:
    config = PlaitConfig.model_validate(
        {"parallel": {"dp_strategy": "zero3", "transforms": {"compile": compile.NAME}}}
    )
    compile._refuse_untested_layouts(config)
    assert not compile.breaks_between_pieces(config)


@pytest.mark.parametrize("axis", AXES)
def test_fullgraph_is_refused_with_each_saying_why(axis: str) -> None:
    config = _config(axis, {}, compile={"fullgraph": True})
    with pytest.raises(ConfigError, match=rf"parallel\.{axis} = 2 with compile.fullgraph = true"):
        compile._refuse_untested_layouts(config)
