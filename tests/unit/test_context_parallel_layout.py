"""The context-parallel sequence layout and the strategy's configuration checks, on one process."""

from __future__ import annotations

import pytest
import torch

from plait.core.errors import ConfigError
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel import ContextParallelConfig, _ulysses_degree
from plait.plugins.context_parallel.ring import block_pairs
from plait.plugins.context_parallel.ulysses import check_heads, kv_repeats


def _layouts(degree: int, ulysses: int, balanced: bool = True) -> list[ContextParallelism]:
    return [
        ContextParallelism(
            degree=degree,
            rank=rank,
            strategy="hybrid",
            ring_degree=degree // ulysses,
            ulysses_degree=ulysses,
            load_balanced=balanced,
        )
        for rank in range(degree)
    ]


@pytest.mark.parametrize(("degree", "ulysses"), [(2, 1), (4, 1), (4, 4), (4, 2), (8, 2)])
def test_every_position_is_held_by_exactly_one_rank(degree: int, ulysses: int) -> None:
    held = torch.cat([layout.positions(32) for layout in _layouts(degree, ulysses)])
    assert sorted(held.tolist()) == list(range(32))


def test_load_balanced_ring_holds_chunks_i_and_mirror() -> None:
    layouts = _layouts(4, 1)
    # 32 positions in 8 chunks of 4: rank 1 holds chunks 1 and 6.
    assert layouts[1].positions(32).tolist() == [4, 5, 6, 7, 24, 25, 26, 27]
    assert _layouts(4, 1, balanced=False)[1].positions(32).tolist() == list(range(8, 16))
    # Ulysses alone: contiguous pieces, so an all-to-all gathers the sequence in order.
    assert _layouts(4, 4)[2].positions(32).tolist() == list(range(16, 24))


def test_shard_batch_cuts_sequence_tensors_only() -> None:
    layout = _layouts(2, 1)[0]
    tokens = torch.arange(16).view(2, 8)
    batch = {"input_ids": tokens, "labels": tokens + 100, "bias": torch.ones(2, 3)}
    sharded = layout.shard_batch(batch, 8)
    assert sharded["input_ids"].tolist() == [[0, 1, 6, 7], [8, 9, 14, 15]]
    assert sharded["labels"].tolist() == [[100, 101, 106, 107], [108, 109, 114, 115]]
    assert sharded["bias"].shape == (2, 3)
    with pytest.raises(ValueError, match="multiple of 4"):
        layout.shard_batch(torch.zeros(1, 6), 6)


def test_block_pairs_follow_causal_order() -> None:
    # Rank 0 of a 2-ring holds chunks (0, 3); rank 1's block is chunks (1, 2).
    assert block_pairs((0, 3), (1, 2)) == [(1, 0, False), (1, 1, False)]
    assert block_pairs((1, 2), (0, 3)) == [(0, 0, False), (1, 0, False)]
    assert block_pairs((0, 3), (0, 3)) == [(0, 0, True), (1, 0, False), (1, 1, True)]


def test_ulysses_degree_must_fit_the_heads() -> None:
    with pytest.raises(ConfigError, match=r"'ring'.*'hybrid'"):
        check_heads(6, 2, 4, where="parallel.cp = 4")
    check_heads(4, 2, 4, where="here")  # kv heads repeated twice
    assert kv_repeats(4, 2, 4) == 2 and kv_repeats(8, 4, 2) == 1
    config = ContextParallelConfig()
    assert _ulysses_degree("hybrid", 4, config, 4) == 2
    assert _ulysses_degree("hybrid", 8, config, 4) == 4
    with pytest.raises(ConfigError, match="does not divide"):
        _ulysses_degree("hybrid", 4, ContextParallelConfig(ulysses_degree=3), 4)
