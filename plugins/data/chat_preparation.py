"""`prepare_conversations`: chat data into a token directory with a loss mask (`--chat`).

    tokenizer = load_chat_tokenizer("tokenizer-dir/")
    report = prepare_conversations(["chats.jsonl"], "tokens/", tokenizer=tokenizer,
                                   train_on="assistant", max_tokens=2048, workers=4)
    report.meta.trained_tokens, report.skipped        # tokens trained on, bad rows by reason

Each row's `messages` (`chat_readers`) is rendered through the tokenizer's chat template
(`chat_template`) and written as one document, followed by the EOS token like every prepared
document, with `loss_mask.bin` marking the tokens `train_on` selects (the EOS is trained only
with `train_on="all"`: the template's own end-of-turn tokens teach the model to stop). The
samplers then score only those tokens, in every packing.

A conversation longer than `max_tokens` (EOS included; the row length it will be trained in) is
dropped (`too_long="drop"`, reason `too long`) or cut to its first `max_tokens` tokens
(`"truncate"`; still `too long` when nothing trained is left). Every bad row — unreadable,
malformed, a template that fails, too long — is counted by reason and the first ones named, as
`prepare_documents` does; rendering runs on `workers` processes, written in input order, so the
output is the same for any number of workers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal

import numpy as np

from plait.plugins.data.chat_readers import Conversation, read_conversations
from plait.plugins.data.chat_template import (
    TRAIN_ON,
    ChatTokenizer,
    ConversationError,
    RenderedConversation,
    TrainOn,
)
from plait.plugins.data.corpus_preparation import PreparationTally, PrepareReport, Progress
from plait.plugins.data.corpus_readers import BadRow, ReadBatch, input_size
from plait.plugins.data.errors import DataError
from plait.plugins.data.ordered_pool import map_in_order
from plait.plugins.data.token_files import TokenDirectoryWriter, check_ids
from plait.plugins.data.tokenizer import document_eos, token_dtype

TooLong = Literal["drop", "truncate"]
TOO_LONG: tuple[TooLong, ...] = ("drop", "truncate")


def prepare_conversations(
    inputs: Sequence[Path | str],
    output_dir: Path | str,
    *,
    tokenizer: ChatTokenizer,
    messages_field: str = "messages",
    split: str = "train",
    train_on: TrainOn = "assistant",
    max_tokens: int | None = None,
    too_long: TooLong = "drop",
    workers: int = 1,
    progress: Progress | None = None,
) -> PrepareReport:
    """Render the conversations of `inputs` into `output_dir` (tokens.bin, documents.bin,
    loss_mask.bin, meta.json). Bad rows are skipped and reported; none left is a `DataError`."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise DataError("prepare_conversations needs at least one input")
    for path in paths:
        if not path.exists():
            raise DataError(f"input {str(path)!r} is not a file or folder")
    if workers < 1:
        raise DataError(f"workers must be >= 1, got {workers}")
    if train_on not in TRAIN_ON:
        raise DataError(f"--train-on must be one of {', '.join(TRAIN_ON)}, got {train_on!r}")
    if too_long not in TOO_LONG:
        raise DataError(f"--too-long must be one of {', '.join(TOO_LONG)}, got {too_long!r}")
    if max_tokens is not None and max_tokens < 2:
        raise DataError(f"--max-tokens must be >= 2 (a token and the EOS), got {max_tokens}")
    eos = document_eos(tokenizer)
    dtype = token_dtype(eos.vocab_size)
    sizes = [input_size(path) for path in paths]
    total_size = sum(sizes)
    tally = PreparationTally(paths, sizes)
    fit = _Fit(eos_id=eos.eos_id, train_eos=train_on == "all", limit=max_tokens, cut=too_long)
    with TokenDirectoryWriter(output_dir, dtype=dtype, documents=True, loss_mask=True) as writer:
        rendered = map_in_order(
            _render_batch,
            _read_all(paths, messages_field=messages_field, split=split),
            workers=workers,
            initializer=_start_worker,
            initargs=(tokenizer, train_on),
        )
        for (index, batch), results in rendered:
            documents: list[RenderedConversation] = []
            outcomes = iter(results)
            for record in batch.records:
                outcome = next(outcomes) if isinstance(record, Conversation) else record
                if isinstance(outcome, tuple):  # the reason rendering failed
                    outcome = BadRow(record.source, record.row, *outcome)
                if isinstance(outcome, RenderedConversation):
                    outcome = fit(outcome, record)
                if isinstance(outcome, BadRow):
                    tally.bad(index, outcome)
                    continue
                check_ids(outcome.ids, tokenizer.vocab_size, tokenizer.name, record.source)
                documents.append(outcome)
            if documents:
                lengths = np.fromiter((d.ids.size for d in documents), np.int64, len(documents))
                writer.write(
                    np.concatenate([d.ids for d in documents]).astype(dtype, copy=False),
                    document_starts=np.cumsum(lengths) - lengths,
                    loss_mask=np.concatenate([d.trained for d in documents]),
                )
                tally.wrote(index, tokens=int(lengths.sum()), documents=len(documents))
            if progress is not None:
                progress(sum(sizes[:index]) + min(batch.progress, sizes[index]), total_size)
        meta = tally.commit(
            writer,
            eos=eos,
            tokenizer=tokenizer.name,
            nothing="inputs {inputs} hold no conversation to train on ({reasons}); "
            "check --messages-field",
        )
    return tally.report(output_dir, meta, eos)


class _Fit:
    """A rendered conversation with its EOS, within `limit` tokens, or why it cannot be."""

    def __init__(self, *, eos_id: int, train_eos: bool, limit: int | None, cut: TooLong) -> None:
        self.eos_id = eos_id
        self.train_eos = train_eos
        self.limit = limit
        self.cut = cut

    def __call__(
        self, rendered: RenderedConversation, record: Conversation
    ) -> RenderedConversation | BadRow:
        ids = np.append(rendered.ids, self.eos_id)
        trained = np.append(rendered.trained, self.train_eos)
        if self.limit is None or ids.size <= self.limit:
            return RenderedConversation(ids=ids, trained=trained)
        detail = f"{ids.size:,} tokens with its EOS, more than --max-tokens {self.limit:,}"
        if self.cut == "drop":
            return BadRow(record.source, record.row, "too long", detail)
        # The cut keeps the first limit - 1 tokens and ends the document with EOS all the same.
        ids = np.append(ids[: self.limit - 1], self.eos_id)
        trained = np.append(trained[: self.limit - 1], self.train_eos)
        if not trained[:-1].any():
            return BadRow(record.source, record.row, "too long", f"{detail}; cut, none trained")
        return RenderedConversation(ids=ids, trained=trained)


def _read_all(
    paths: Sequence[Path], *, messages_field: str, split: str
) -> Iterator[tuple[int, ReadBatch]]:
    for index, path in enumerate(paths):
        for batch in read_conversations(path, messages_field=messages_field, split=split):
            yield index, batch


# ---------------------------------------------------------------------------------------------
# rendering, in this process or on a pool of processes
# ---------------------------------------------------------------------------------------------

_worker: tuple[ChatTokenizer, TrainOn] | None = None


def _start_worker(tokenizer: ChatTokenizer, train_on: TrainOn) -> None:
    global _worker
    _worker = (tokenizer, train_on)


def _render_batch(
    item: tuple[int, ReadBatch],
) -> list[RenderedConversation | tuple[str, str]]:
    """Each conversation of the batch rendered, or `(reason, detail)` of its failure."""
    assert _worker is not None
    tokenizer, train_on = _worker
    results: list[RenderedConversation | tuple[str, str]] = []
    for record in item[1].records:
        if not isinstance(record, Conversation):
            continue
        try:
            results.append(tokenizer.render(record.messages, train_on))
        except ConversationError as error:
            results.append((error.reason, error.detail))
    return results
