"""What a heal refuses, and what the chunk exchange plans, without processes: a peer group of
another size or plait version is refused by name; overlaps are cut in global coordinates; a
rank's need that the group's chunks do not cover exactly is an error, never a partial load."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from plait.core.state_chunks import TensorChunk
from plait.plugins.fault_tolerance.chunk_exchange import (
    ExchangeError,
    check_coverage,
    chunk_shapes,
    plan_overlaps,
)
from plait.plugins.fault_tolerance.healing import HEAL_FORMAT, HealingError, load_heal_state


def _engine(world_size: int) -> SimpleNamespace:
    return SimpleNamespace(mesh=SimpleNamespace(world_size=world_size))


def test_a_peer_group_of_another_size_is_refused() -> None:
    with pytest.raises(HealingError, match=r"group of 4 ranks: this group has 2"):
        load_heal_state(_engine(2), None, {"format": HEAL_FORMAT, "group_size": 4})


def test_a_peer_on_another_heal_format_is_refused() -> None:
    with pytest.raises(HealingError, match=r"format 1"):
        load_heal_state(_engine(2), None, {"format": 1, "group_size": 2})


def _chunk(offsets: tuple[int, ...], shape: tuple[int, ...]) -> TensorChunk:
    return TensorChunk(offsets, torch.zeros(shape))


def test_overlaps_are_planned_in_global_coordinates() -> None:
    # Held: rows 0-2 of a 6x4 tensor; wanted: rows 2-5 (a ZeRO-3 rank's block, say).
    held = {"model.w": [_chunk((0, 0), (3, 4))]}
    wanted = {"model.w": [_chunk((2, 0), (4, 4))]}
    (overlap,) = plan_overlaps(chunk_shapes(held), chunk_shapes(wanted))
    assert (overlap.offsets, overlap.sizes, overlap.nbytes) == ((2, 0), (1, 4), 16)


def test_a_need_the_group_does_not_cover_is_an_error() -> None:
    held = {"model.w": [_chunk((0, 0), (3, 4))]}
    wanted = {"model.w": [_chunk((2, 0), (4, 4))]}
    with pytest.raises(ExchangeError, match=r"model\.w: the group holds 4 of the 16 elements"):
        check_coverage(wanted, [plan_overlaps(chunk_shapes(held), chunk_shapes(wanted))])


def test_elements_held_twice_are_an_error() -> None:
    held = {"model.w": [_chunk((0,), (4,)), _chunk((2,), (4,))]}
    wanted = {"model.w": [_chunk((0,), (6,))]}
    with pytest.raises(ExchangeError, match="some twice"):
        check_coverage(wanted, [plan_overlaps(chunk_shapes(held), chunk_shapes(wanted))])
