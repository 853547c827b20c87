"""`plait.core.documents` and `plait.core.token_loss` on their own: edge cases of packed rows.

Documents from restarting positions and from `cu_seqlens` (one document per row, every
document of one token, rows cut mid-document), broken position ids named in the error, the
mask; scored-token counting for both loss conventions, the step's weights, and a micro-batch
that scores no token: it adds nothing to the loss and leaves every gradient finite.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from plait.core.documents import Documents, document_mask, documents_of, restarting_positions
from plait.core.errors import PlaitError
from plait.core.microbatch import MicrobatchRunner
from plait.core.sharding import StepState
from plait.core.token_loss import IGNORE_INDEX, TokenWeights, scored_tokens, token_weights

CPU = torch.device("cpu")


def positions_of(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths])


def test_ids_offsets_and_lengths_of_packed_rows() -> None:
    documents = Documents.from_positions(positions_of([[2, 1, 3], [4, 2]]))
    assert documents.document_ids.tolist() == [[0, 0, 1, 2, 2, 2], [3, 3, 3, 3, 4, 4]]
    assert documents.document_ids.dtype == torch.int32
    assert documents.cu_seqlens.tolist() == [0, 2, 3, 6, 10, 12]
    assert documents.lengths().tolist() == [2, 1, 3, 4, 2]
    assert (documents.count, documents.max_seqlen, documents.rows, documents.seq_len) == (
        5,
        4,
        2,
        6,
    )
    assert documents.attention_pairs() == 3 + 1 + 6 + 10 + 3


def test_a_row_of_one_document() -> None:
    documents = Documents.from_positions(torch.arange(7)[None])
    assert documents.document_ids.tolist() == [[0] * 7]
    assert documents.cu_seqlens.tolist() == [0, 7]
    assert documents.attention_pairs() == 28


def test_every_document_of_one_token() -> None:
    documents = Documents.from_positions(torch.zeros(2, 5, dtype=torch.long))
    assert documents.document_ids.tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert documents.lengths().tolist() == [1] * 10
    allowed = document_mask(documents.document_ids, documents.document_ids, causal=True)
    assert torch.equal(allowed[:, 0], torch.eye(5, dtype=torch.bool).expand(2, 5, 5))


def test_a_row_cut_mid_document_starts_a_document() -> None:
    """A row that begins inside a document (positions 3, 4, …) continues it as its own."""
    documents = Documents.from_positions(torch.tensor([[3, 4, 0, 1], [5, 6, 7, 0]]))
    assert documents.document_ids.tolist() == [[0, 0, 1, 1], [2, 2, 2, 3]]
    assert documents.positions.tolist() == [[3, 4, 0, 1], [5, 6, 7, 0]]


def test_cu_seqlens_input_gives_the_same_documents() -> None:
    lengths = [[2, 1, 3], [4, 2]]
    from_positions = Documents.from_positions(positions_of(lengths))
    from_offsets = Documents.from_cu_seqlens(torch.tensor([0, 2, 3, 6, 10, 12]), 6, rows=2)
    assert torch.equal(from_offsets.document_ids, from_positions.document_ids)
    assert torch.equal(from_offsets.positions, from_positions.positions)
    assert torch.equal(from_offsets.cu_seqlens, from_positions.cu_seqlens)
    # A document running over a row end is cut there: every row starts a document.
    across = Documents.from_cu_seqlens(torch.tensor([0, 4, 12]), 6, rows=2)
    assert across.document_ids.tolist() == [[0, 0, 0, 0, 1, 1], [2, 2, 2, 2, 2, 2]]
    assert across.positions.tolist() == [[0, 1, 2, 3, 0, 1], list(range(6))]
    assert across.cu_seqlens.tolist() == [0, 4, 6, 12]


def test_transformers_varlen_batch() -> None:
    batch = {
        "input_ids": torch.ones(1, 6, dtype=torch.long),
        "cu_seq_lens_q": torch.tensor([0, 3, 6]),
    }
    documents = documents_of(batch)
    assert documents is not None
    assert documents.document_ids.tolist() == [[0, 0, 0, 1, 1, 1]]
    assert documents.positions.tolist() == [[0, 1, 2, 0, 1, 2]]


@pytest.mark.parametrize(
    ("offsets", "match"),
    [
        ([1, 6], "start at 0"),
        ([0, 3, 3, 6], "increase strictly"),
        ([0, 4], "up to rows·seq = 6"),
    ],
)
def test_bad_cu_seqlens_are_named(offsets: list[int], match: str) -> None:
    with pytest.raises(PlaitError, match=match):
        Documents.from_cu_seqlens(torch.tensor(offsets), 6)


def test_broken_position_ids_name_the_row_and_column() -> None:
    positions = torch.tensor([[0, 1, 2, 0, 1], [0, 1, 3, 4, 5]])
    with pytest.raises(PlaitError, match="row 1 goes from 1 to 3 at column 2"):
        Documents.from_positions(positions)
    with pytest.raises(PlaitError, match="integer tensor"):
        Documents.from_positions(positions.float())


def test_plain_rows_are_not_packed() -> None:
    plain = {"positions": torch.arange(8).expand(3, 8)}
    assert restarting_positions(plain) is None
    assert documents_of(plain) is None
    assert documents_of(torch.zeros(2, 8)) is None
    packed = {"position_ids": positions_of([[3, 5]])}
    assert torch.equal(restarting_positions(packed), packed["position_ids"])


def test_the_mask_is_causal_inside_documents_only() -> None:
    ids = torch.tensor([[0, 0, 1, 1]])
    allowed = document_mask(ids, ids, causal=True)[0, 0].int().tolist()
    assert allowed == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    keys = torch.tensor([[0, 0, 0, 1, 1, 1]])  # two more keys before: bottom-right causal
    allowed = document_mask(ids, keys, causal=True)[0, 0].int().tolist()
    assert allowed == [
        [1, 1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]


# -- token_loss --------------------------------------------------------------------------------


def test_scored_tokens_by_convention() -> None:
    targets = torch.tensor([[5, IGNORE_INDEX, 7], [IGNORE_INDEX] * 3])
    assert int(scored_tokens(None, targets, "targets")) == 2
    labels = torch.tensor([[IGNORE_INDEX, 4, 5, IGNORE_INDEX, 6]])
    # A causal LM scores labels[:, 1:]: the first label is never a target.
    assert int(scored_tokens({"labels": labels}, None, "shifted_labels")) == 3
    shifted = torch.tensor([[4, IGNORE_INDEX]])
    assert (
        int(scored_tokens({"labels": labels, "shift_labels": shifted}, None, "shifted_labels")) == 1
    )
    # Losses plait cannot see inside are not weighed.
    assert (
        scored_tokens({"labels": labels, "num_items_in_batch": 3}, None, "shifted_labels") is None
    )
    assert scored_tokens(None, targets, None) is None
    assert scored_tokens(None, targets.float(), "targets") is None


def test_weights_make_the_mean_over_every_scored_token() -> None:
    """Two ranks (the other's 8 tokens added by a simulated sum) and micro-batches of 3, 0 and 5
    scored tokens: each mean loss is weighed c·R/N before backward."""

    def all_reduce_sum(total: torch.Tensor) -> None:
        total += 8.0

    counts = [torch.tensor(3), torch.tensor(0), torch.tensor(5)]
    weights = token_weights(counts, all_reduce_sum=all_reduce_sum, replicas=2, device=CPU)
    assert weights is not None
    assert weights.scored.tolist() == [3.0, 0.0, 5.0]
    assert weights.global_scored.item() == 16.0
    loss = torch.tensor(2.0)
    weighed = [weights.weigh(i, loss).item() for i in range(3)]
    assert weighed == [2.0 * 3 * 2 / 16, 0.0, 2.0 * 5 * 2 / 16]
    # A loss that cannot be weighed: the rank still joins the sum (its peers wait on it).
    calls: list[float] = []
    unweighable = token_weights(
        [torch.tensor(3), None], all_reduce_sum=lambda t: calls.append(t.item()), replicas=1,
        device=CPU,
    )  # fmt: skip
    assert unweighable is None and calls == [0.0]
    # A step scoring nothing anywhere trains on nothing (no 0 / 0).
    nothing = token_weights(
        [torch.tensor(0)], all_reduce_sum=lambda t: None, replicas=1, device=CPU
    )
    assert nothing is not None and nothing.weigh(0, torch.tensor(float("nan"))).item() == 0.0


def _runner_loss(targets: torch.Tensor, weights: TokenWeights | None, logits: torch.Tensor) -> Any:
    def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())

    runner = MicrobatchRunner(
        runtimes=(), loss_fn=cross_entropy, positions={}, num_microbatches=1, weights=weights
    )
    state = StepState(
        inputs=[None], targets=[targets], losses=[None], num_microbatches=1, runner=runner
    )
    return runner.loss(state, 0, logits), state


def test_a_micro_batch_scoring_no_token_adds_nothing_and_no_nan() -> None:
    """Its mean is 0/0 = NaN; through cross-entropy the scaled loss must be 0 with finite (zero)
    gradients, or one empty micro-batch would poison the step's gradients."""
    logits = torch.randn(2, 4, 11, requires_grad=True)
    targets = torch.full((2, 4), IGNORE_INDEX)
    weights = TokenWeights(scored=torch.tensor([0.0]), global_scored=torch.tensor(6.0), replicas=1)
    scaled, state = _runner_loss(targets, weights, logits)
    assert torch.isnan(state.losses[0])  # recorded as it is; the step's mean weighs it 0
    assert scaled.item() == 0.0
    scaled.backward()
    assert torch.isfinite(logits.grad).all()
    assert not logits.grad.any()


def test_a_weighed_micro_batch_scales_by_its_share() -> None:
    logits = torch.randn(1, 4, 11, requires_grad=True)
    targets = torch.tensor([[1, IGNORE_INDEX, 3, 4]])
    weights = TokenWeights(scored=torch.tensor([3.0]), global_scored=torch.tensor(12.0), replicas=2)
    scaled, state = _runner_loss(targets, weights, logits)
    assert scaled.item() == pytest.approx(state.losses[0].item() * 3 * 2 / 12)


def test_a_diverged_micro_batch_still_shows_nan() -> None:
    """Only a micro-batch with nothing to score is silenced; NaN logits on scored tokens are not."""
    logits = torch.full((1, 4, 11), float("nan"), requires_grad=True)
    targets = torch.tensor([[1, IGNORE_INDEX, 3, 4]])
    weights = TokenWeights(scored=torch.tensor([3.0]), global_scored=torch.tensor(3.0), replicas=1)
    scaled, _ = _runner_loss(targets, weights, logits)
    assert torch.isnan(scaled)
