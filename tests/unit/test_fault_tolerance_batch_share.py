"""`keep_global_batch`'s pieces without processes: who reads which missing share, reading another
rank's slice of a step, joining shares, and the setting's validation."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from plait.core.errors import ConfigError, PlaitError
from plait.plugins.data import DataError, PackedBatches, TokenBatches
from plait.plugins.data.documents_file import starts_from_lengths
from plait.plugins.data.token_files import TokenDirectoryWriter, TokenFile
from plait.plugins.data.tokenizer import token_dtype
from plait.plugins.fault_tolerance.batch_share import (
    GlobalBatchKeeper,
    assign_missing_shares,
    concatenate_rows,
)
from plait.plugins.fault_tolerance.config import FaultToleranceConfig


def _live_sets(groups: int) -> list[tuple[int, ...]]:
    return [
        live
        for count in range(1, groups + 1)
        for live in itertools.combinations(range(groups), count)
    ]


@pytest.mark.parametrize("groups", [1, 2, 3, 4, 5])
def test_every_share_is_read_exactly_once_by_a_live_group(groups: int) -> None:
    for live in _live_sets(groups):
        plan = assign_missing_shares(live, groups)
        assert sorted(plan) == list(live)
        read = Counter(share for shares in plan.values() for share in shares)
        assert read == Counter(range(groups)), (live, plan)
        for group, shares in plan.items():
            assert group in shares and list(shares) == sorted(shares)
        # Balanced: no survivor reads two shares more than another.
        loads = [len(shares) for shares in plan.values()]
        assert max(loads) - min(loads) <= 1


def test_the_assignment_depends_only_on_who_is_live() -> None:
    # Every survivor computes it from the quorum's presence vector, in whatever order it lists.
    assert assign_missing_shares((2, 0), 4) == assign_missing_shares([0, 2, 2], 4)
    assert assign_missing_shares((0, 2), 4) == {0: (0, 1), 2: (2, 3)}
    assert assign_missing_shares((0, 1), 3) == {0: (0, 2), 1: (1,)}
    assert assign_missing_shares((1,), 2) == {1: (0, 1)}
    assert assign_missing_shares((0, 1), 2) == {0: (0,), 1: (1,)}


def test_an_impossible_quorum_is_an_error() -> None:
    with pytest.raises(PlaitError, match="no replica group is live"):
        assign_missing_shares((), 2)
    with pytest.raises(PlaitError, match=r"0 \.\. 1"):
        assign_missing_shares((0, 2), 2)


def _counting_file(directory: Path) -> TokenFile:
    count = 2001
    with TokenDirectoryWriter(directory, dtype=token_dtype(count + 1), documents=False) as writer:
        writer.write(np.arange(count, dtype=np.int64))
        writer.commit(vocab_size=count + 1, tokenizer="counting", sources=())
    return TokenFile(directory)


def test_token_sampler_reads_another_ranks_slice_of_the_same_step(tmp_path: Path) -> None:
    token_file = _counting_file(tmp_path / "tokens")
    mine = TokenBatches(token_file, seq_len=8, global_batch_size=6, dp_rank=0, dp_size=3, seed=1)
    whole = TokenBatches(token_file, seq_len=8, global_batch_size=6, seed=1)
    for step in (0, 5, 40):  # 40: a later epoch
        for rank in range(3):
            other = TokenBatches(
                token_file, seq_len=8, global_batch_size=6, dp_rank=rank, dp_size=3, seed=1
            )
            for got, expected in zip(
                mine.batch_at(step, dp_rank=rank), other.batch_at(step), strict=True
            ):
                assert torch.equal(got, expected)
        # The shares joined in rank order are the step's global batch.
        joined = concatenate_rows([mine.batch_at(step, dp_rank=r) for r in range(3)])
        for got, expected in zip(joined, whole.batch_at(step), strict=True):
            assert torch.equal(got, expected)
    assert mine.step == 0  # reading moves nothing
    with pytest.raises(DataError, match=r"dp_rank must be in \[0, dp_size=3\), got 3"):
        mine.batch_at(0, dp_rank=3)


def test_packed_sampler_reads_another_ranks_slice_of_the_same_step(tmp_path: Path) -> None:
    lengths = np.random.default_rng(3).integers(1, 30, size=200)
    directory = tmp_path / "docs"
    with TokenDirectoryWriter(directory, dtype=token_dtype(5000), documents=True) as writer:
        total = int(lengths.sum())
        writer.write(
            np.arange(1, total + 1, dtype=np.int64), document_starts=starts_from_lengths(lengths)
        )
        writer.commit(vocab_size=total + 1, tokenizer="counting", sources=())
    token_file = TokenFile(directory)

    def sampler(rank: int) -> PackedBatches:
        packing = "first_fit"
        return PackedBatches(
            token_file, seq_len=16, global_batch_size=4, packing=packing, dp_rank=rank, dp_size=2
        )

    mine, other = sampler(0), sampler(1)
    for step in (0, 3):
        got, expected = mine.batch_at(step, dp_rank=1), other.batch_at(step)
        assert torch.equal(got[1], expected[1])
        for key in expected[0]:
            assert torch.equal(got[0][key], expected[0][key])


def test_joining_shares_of_different_kinds_is_an_error() -> None:
    rows = torch.zeros(2, 4, dtype=torch.long)
    with pytest.raises(PlaitError, match="different structures"):
        concatenate_rows([(rows, rows), {"input_ids": rows}])
    joined = concatenate_rows([{"input_ids": rows, "flag": 1}, {"input_ids": rows, "flag": 1}])
    assert joined["input_ids"].shape == (4, 4) and joined["flag"] == 1
    with pytest.raises(PlaitError, match="non-tensor entry"):
        concatenate_rows([{"input_ids": rows, "flag": 1}, {"input_ids": rows, "flag": 2}])


def test_keep_global_batch_needs_fault_tolerance_on() -> None:
    with pytest.raises(ValidationError, match="keep_global_batch = true only acts across"):
        FaultToleranceConfig(keep_global_batch=True)
    on = FaultToleranceConfig(
        replica_group=1, replica_groups=2, lighthouse="127.0.0.1:29510", keep_global_batch=True
    )
    assert on.keep_global_batch
    assert not FaultToleranceConfig().keep_global_batch
    with pytest.raises(ValidationError, match="keep_global_batch"):
        FaultToleranceConfig(
            replica_group=0, replica_groups=2, lighthouse="127.0.0.1:1", keep_global_batch="maybe"
        )


def test_a_sampler_that_cannot_read_other_shares_is_refused(tmp_path: Path) -> None:
    token_file = _counting_file(tmp_path / "tokens")

    def keeper(batches: object) -> GlobalBatchKeeper:
        return GlobalBatchKeeper(
            manager=None,
            batches=batches,  # type: ignore[arg-type]
            group=1,
            groups=2,
            dp_rank=0,
            dp_size=1,
            micro_batch_size_for=lambda rows: rows,
            device=torch.device("cpu"),
        )

    with pytest.raises(ConfigError, match="keep_global_batch needs a sampler"):
        keeper(iter([]))
    # Built for one process, not with replica_data_coordinates: it would read group 0's rows.
    alone = TokenBatches(token_file, seq_len=8, global_batch_size=4, seed=1)
    with pytest.raises(ConfigError, match="reads rank 0 of 1, but group 1's rank 0 of 1"):
        keeper(alone)
    share = TokenBatches(token_file, seq_len=8, global_batch_size=4, dp_rank=1, dp_size=2)
    assert keeper(share).micro_batch_size == 2
