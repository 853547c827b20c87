"""DDP against a single process on the same global batch and seed; overlap of bucket reductions."""

from __future__ import annotations

import pytest
import torch

from plait.testing.distributed import run_distributed
from tests.dist import ddp_workers

pytestmark = pytest.mark.dist

# fp32 on CPU: summation order differs between one process and an all-reduce of two halves.
LOSS_TOL = 1e-5
GRAD_TOL = 1e-5


@pytest.mark.parametrize("micro_batch", [8, 2], ids=["no-accumulation", "accumulate-4"])
def test_dp2_matches_single_process(micro_batch: int) -> None:
    steps, global_batch = 6, 16
    (single,) = run_distributed(
        ddp_workers.train_user_model, 1, steps, global_batch, micro_batch * 2, 0.001
    )
    dp2 = run_distributed(ddp_workers.train_user_model, 2, steps, global_batch, micro_batch, 0.001)
    assert single["losses"][-1] < single["losses"][0], "training should make progress"
    for rank_result in dp2:
        assert rank_result["num_buckets"] > 1
        torch.testing.assert_close(
            torch.tensor(rank_result["losses"]),
            torch.tensor(single["losses"]),
            rtol=LOSS_TOL,
            atol=LOSS_TOL,
        )
        for step, (got, want) in enumerate(zip(rank_result["grads"], single["grads"], strict=True)):
            for key in want:
                torch.testing.assert_close(
                    got[key],
                    want[key],
                    rtol=GRAD_TOL,
                    atol=GRAD_TOL,
                    msg=lambda m, s=step, k=key: f"step {s} param {k}: {m}",
                )


def test_first_bucket_all_reduce_issued_during_backward() -> None:
    results = run_distributed(ddp_workers.overlap_probe, 2)
    for r in results:
        assert r["num_buckets"] >= 3
        assert len(r["issued_ns"]) == r["num_buckets"]
        first = r["issued_ns"][0]
        assert r["backward_start_ns"] < first < r["backward_end_ns"], (
            "the first bucket must be reduced while backward is still running"
        )
        # The overlap itself: the first bucket is on the wire before the last bucket has any
        # of its gradients, so a variant that launches buckets only once backward is done (or
        # once every gradient is ready) fails here.
        assert first < max(r["last_bucket_ready_ns"]), (
            "the first bucket's all-reduce must be issued before the last bucket's gradients "
            "are ready"
        )


def test_buckets_follow_backward_order_and_hold_the_gradients() -> None:
    results = run_distributed(ddp_workers.bucket_layout_probe, 2)
    for r in results:
        rebuilt, kept = r["rebuild=True"], r["rebuild=False"]
        # The first guess (reverse registration) starts with the embedding, whose gradient is
        # the last one backward produces; after the first step the buckets follow backward.
        assert rebuilt["before"][0][0] == "embed.weight"
        assert [n for b in rebuilt["after"] for n in b] == rebuilt["ready_order"]
        assert rebuilt["after"][0][0] == rebuilt["ready_order"][0] != "embed.weight"
        assert kept["after"] == kept["before"]
        for layout in (rebuilt, kept):
            # The first bucket is capped (a single larger parameter still gets a bucket).
            cap = max(0.004 * 2**20, layout["first_bucket_largest_param"])
            assert layout["first_bucket_bytes"] <= cap
            assert len(layout["after"]) > 2
            # Gradients live in the buckets (no copy in or out), across the rebuild too.
            assert layout["grads_are_bucket_views"]
        torch.testing.assert_close(
            torch.tensor(rebuilt["losses"]), torch.tensor(kept["losses"]), rtol=1e-6, atol=1e-6
        )
    assert results[0]["rebuild=True"]["after"] == results[1]["rebuild=True"]["after"]
