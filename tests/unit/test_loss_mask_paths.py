"""A token directory's loss mask reaches the loss on every path that reads it: each packing, with
and without document masking, the held-out split, and dp slices; the stream sampler, which
cannot honour it, refuses it by name; directories without a mask read as before.

The mask is a function of the token value here (`trained(t)`), so the expected loss is computed
by hand from the unmasked targets alone: a target is scored iff it is scored without the mask
and its token is trained."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from plait.core.config import DataSection
from plait.plugins.data import DataError, PackedBatches, TokenBatches, TokenFile, build_batches
from plait.plugins.data.documents_file import starts_from_lengths
from plait.plugins.data.packing import IGNORE_INDEX
from plait.plugins.data.token_files import TokenDirectoryWriter, TokenFileError
from plait.plugins.data.tokenizer import token_dtype

VOCAB = 40
LENGTHS = [9, 3, 17, 5, 12, 7, 21, 4, 8, 15, 6, 11]
SEQ_LEN = 16
BATCH = 4


def trained(tokens: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
    """Which token values the directory's mask trains: a pattern no shift of it reproduces."""
    return (tokens % 3 != 0) & (tokens != 7)


def write_directory(directory: Path, *, masked: bool) -> TokenFile:
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, VOCAB, size=sum(LENGTHS))
    with TokenDirectoryWriter(
        directory, dtype=token_dtype(VOCAB), documents=True, loss_mask=masked
    ) as writer:
        writer.write(
            tokens,
            document_starts=starts_from_lengths(np.array(LENGTHS)),
            loss_mask=trained(tokens) if masked else None,
        )
        writer.commit(vocab_size=VOCAB, tokenizer="random", eos_id=0, sources=())
    return TokenFile(directory, verify_checksum=True)


@pytest.fixture(scope="module")
def directories(tmp_path_factory: pytest.TempPathFactory) -> tuple[TokenFile, TokenFile]:
    root = tmp_path_factory.mktemp("mask")
    return write_directory(root / "masked", masked=True), write_directory(
        root / "plain", masked=False
    )


def token_loss(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of fixed logits that depend on the input token only (a bigram table), as
    the engine's token loss computes it: a mean over targets other than IGNORE_INDEX."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))
    return F.cross_entropy(
        table[tokens].flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX
    )


def hand_masked_loss(tokens: torch.Tensor, plain_targets: torch.Tensor) -> torch.Tensor:
    """The masked loss by hand, token by token, from the unmasked targets."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0))
    total, count = 0.0, 0
    for token, target in zip(
        tokens.flatten().tolist(), plain_targets.flatten().tolist(), strict=True
    ):
        if target != IGNORE_INDEX and bool(trained(np.int64(target))):
            total -= torch.log_softmax(table[token].double(), dim=0)[target].item()
            count += 1
    return torch.tensor(total / count, dtype=torch.float64)


def check_masked(masked: list[tuple], plain: list[tuple]) -> None:
    """Batches of the masked directory against the same batches of the plain one: the same rows,
    the targets of untrained tokens ignored, and a loss over them all that differs from the
    unmasked one and equals the hand-computed masked loss."""
    for (inputs, targets), (plain_inputs, plain_targets) in zip(masked, plain, strict=True):
        assert torch.equal(inputs["tokens"], plain_inputs["tokens"])
        assert torch.equal(inputs["positions"], plain_inputs["positions"])
        expected = torch.where(
            (plain_targets != IGNORE_INDEX) & trained(plain_targets),
            plain_targets,
            torch.full_like(plain_targets, IGNORE_INDEX),
        )
        assert torch.equal(targets, expected)
    tokens = torch.cat([inputs["tokens"] for inputs, _ in masked])
    targets = torch.cat([targets for _, targets in masked])
    plain_targets = torch.cat([targets for _, targets in plain])
    loss, plain_loss = token_loss(tokens, targets), token_loss(tokens, plain_targets)
    assert abs(loss.item() - plain_loss.item()) > 1e-3  # the mask changes the result
    hand = hand_masked_loss(tokens, plain_targets)
    assert loss.double().item() == pytest.approx(hand.item(), abs=1e-5)


@pytest.mark.parametrize("document_mask", [True, False])
@pytest.mark.parametrize("packing", ["concat_split", "first_fit", "none"])
def test_every_packing_scores_only_trained_tokens(
    directories: tuple[TokenFile, TokenFile], packing: str, document_mask: bool
) -> None:
    masked_file, plain_file = directories
    samplers = [
        PackedBatches(
            token_file,
            seq_len=SEQ_LEN,
            global_batch_size=BATCH,
            packing=packing,  # type: ignore[arg-type]
            document_mask=document_mask,
            seed=5,
        )
        for token_file in (masked_file, plain_file)
    ]
    steps = range(samplers[0].steps_per_epoch + 1)  # into the second epoch's order too
    check_masked(*([sampler.batch_at(step) for step in steps] for sampler in samplers))


@pytest.mark.parametrize("split", ["train", "validation"])
def test_the_held_out_split_and_dp_slices_score_only_trained_tokens(
    directories: tuple[TokenFile, TokenFile], split: str
) -> None:
    for dp_rank in range(2):
        batches = [
            build_batches(
                DataSection(path=str(token_file.directory), seq_len=SEQ_LEN, packing="none"),
                seq_len=SEQ_LEN,
                global_batch_size=2,
                dp_rank=dp_rank,
                dp_size=2,
                seed=1,
                holdout=0.3,
                split=split,  # type: ignore[arg-type]
            )
            for token_file in directories
        ]
        assert isinstance(batches[0], PackedBatches)
        steps = range(batches[0].steps_per_epoch)
        check_masked(*([sampler.batch_at(step) for step in steps] for sampler in batches))


def test_the_stream_sampler_refuses_a_masked_directory(
    directories: tuple[TokenFile, TokenFile],
) -> None:
    with pytest.raises(DataError, match=r"loss mask \(loss_mask.bin\).*TokenBatches cannot honour"):
        TokenBatches(directories[0], seq_len=SEQ_LEN, global_batch_size=BATCH)


def test_only_a_masked_directory_is_version_3_and_its_mask_is_checked(
    directories: tuple[TokenFile, TokenFile], tmp_path: Path
) -> None:
    masked_file, plain_file = directories
    assert masked_file.meta.format_version == 3 and plain_file.meta.format_version == 2
    assert plain_file.loss_mask is None and not (plain_file.directory / "loss_mask.bin").exists()
    tokens = np.asarray(masked_file.tokens)
    assert np.array_equal(masked_file.loss_mask, trained(tokens).astype(np.uint8))
    assert masked_file.meta.trained_tokens == int(trained(tokens).sum())

    copy = write_directory(tmp_path / "copy", masked=True).directory
    (copy / "loss_mask.bin").write_bytes(bytes(sum(LENGTHS)))  # right size, nothing trained
    with pytest.raises(TokenFileError, match="holds 0 trained tokens"):
        TokenFile(copy)
    (copy / "loss_mask.bin").write_bytes(b"\x01" * 5)
    with pytest.raises(TokenFileError, match="one mask byte each"):
        TokenFile(copy)
    meta = json.loads((copy / "meta.json").read_text())
    del meta["trained_tokens"]
    (copy / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TokenFileError, match="format version 3 needs 'trained_tokens'"):
        TokenFile(copy)
