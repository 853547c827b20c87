"""The banner's parameter figures, read from a state layout (whole, ZeRO-sharded, pipelined)."""

from __future__ import annotations

import torch

from plait.core.state_layout import LocalPiece, ParameterLayout, Region, StateLayout, TensorLayout
from plait.training.banner import parameters_text


def _entry(
    name: str, shape: tuple[int, ...], flat: tuple[int, int] | None = None
) -> ParameterLayout:
    full = torch.zeros(shape)
    if flat is None:
        value = TensorLayout.whole(full)
    else:
        piece = LocalPiece(
            Region.whole(shape).flat_range(*flat), tensor=full.view(-1)[flat[0] : flat[1]]
        )
        value = TensorLayout(global_shape=full.shape, pieces=(piece,), sharded_over=("dp",))
    return ParameterLayout(name=name, param=full, value=value)


def test_a_whole_model_is_all_on_the_rank() -> None:
    layout = StateLayout(parameters=(_entry("w", (4, 8)), _entry("b", (8,))))
    assert parameters_text(layout) == "40 parameters, all on this rank"


def test_a_zero3_rank_is_told_its_share_not_the_models_count_as_its_own() -> None:
    # What ZeRO-3 declares on rank 0 of 2: the first half of each flattened parameter.
    layout = StateLayout(
        parameters=(_entry("w", (400, 300), (0, 60_000)), _entry("b", (8,), (0, 4)))
    )
    assert parameters_text(layout) == "120,008 parameters, 60,004 on this rank"


def test_a_pipeline_rank_counts_its_stage() -> None:
    layout = StateLayout(parameters=(_entry("w", (4, 8)),))
    assert parameters_text(layout, pp=2) == "32 parameters in this stage, all on this rank"
