"""Conversations rendered through a tokenizer's own chat template, with the tokens to train on.

    tokenizer = load_chat_tokenizer("tokenizer-dir/")         # a transformers tokenizer folder
    rendered = tokenizer.render(messages, train_on="assistant")
    rendered.ids, rendered.trained                             # int64 ids, bool mask, aligned

The template is transformers' (`apply_chat_template`), so the tokens are exactly those the model
will see at inference. Which of them are trained:

- a template with `{% generation %}` markers around the assistant's text: transformers' own
  `return_assistant_tokens_mask=True` mask;
- a template without: each assistant turn's text is located in the rendering by rendering the
  conversation up to the turn (with the generation prompt) and through it: the turn is what the
  second adds to the first (its end-of-turn tokens included, so the model learns to stop). The
  tokens whose characters overlap a turn (tokenizer offsets) are trained. A template whose
  rendering of a prefix is not a prefix of the whole (one that rewrites earlier turns once later
  ones follow) cannot be read this way: the conversation is refused as `template failed`.

`train_on`: `assistant` (every assistant turn), `last` (the last one only: the earlier ones are
context, as for a preference or a rejection-sampled answer) or `all` (every token).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from plait.plugins.data.errors import DataError

TrainOn = Literal["assistant", "last", "all"]
TRAIN_ON: tuple[TrainOn, ...] = ("assistant", "last", "all")
GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ConversationError(Exception):
    """A conversation the template cannot render: `reason` is the category it is counted by."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True, eq=False)
class RenderedConversation:
    """A conversation's token ids and which of them are trained."""

    ids: np.ndarray  # int64
    trained: np.ndarray  # bool, aligned with ids


class ChatTokenizer:
    """A transformers tokenizer with a chat template, as token-file preparation uses it: the
    `Tokenizer` protocol (`name`, `vocab_size`, `eos_id`, `encode`, `decode`) and `render`."""

    def __init__(self, tokenizer: Any, *, name: str, chat_template: str | None = None) -> None:
        template = chat_template if chat_template is not None else tokenizer.chat_template
        if not isinstance(template, str) or not template.strip():
            raise DataError(
                f"tokenizer {name!r} has no chat template: give one with --chat-template FILE "
                "(a Jinja file), or use a tokenizer saved with its chat_template"
            )
        self._tokenizer = tokenizer
        self.template = template
        self.name = name
        self.vocab_size = len(tokenizer)
        self.eos_id: int | None = tokenizer.eos_token_id
        self.has_generation_markers = bool(GENERATION_MARKER.search(template))
        if not self.has_generation_markers and not tokenizer.is_fast:
            raise DataError(
                f"tokenizer {name!r} is not a fast tokenizer, so its template's assistant turns "
                "cannot be located by character offsets; use a tokenizer.json (fast) tokenizer, "
                "or a template with {% generation %} markers"
            )

    def encode(self, text: str) -> np.ndarray:
        ids = self._tokenizer(text, add_special_tokens=False)["input_ids"]
        return np.asarray(ids, dtype=np.int64)

    def decode(self, tokens: Iterable[int] | np.ndarray) -> str:
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)]
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def render(self, messages: list[dict[str, Any]], train_on: TrainOn) -> RenderedConversation:
        """`messages` rendered and tokenized, with the tokens `train_on` selects; a template
        that fails, or cannot be read, raises `ConversationError("template failed", …)`."""
        if train_on not in TRAIN_ON:
            raise DataError(f"train_on must be one of {TRAIN_ON}, got {train_on!r}")
        if self.has_generation_markers:
            encoded = self._apply(messages, tokenize=True, return_assistant_tokens_mask=True)
            ids = np.asarray(encoded["input_ids"], dtype=np.int64)
            trained = np.asarray(encoded["assistant_masks"], dtype=bool)
            if train_on == "last":
                trained = _last_run(trained)
        else:
            text = self._apply(messages, tokenize=False)
            encoded = self._tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = np.asarray(encoded["input_ids"], dtype=np.int64)
            offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            trained = np.zeros(ids.size, dtype=bool)
            if train_on != "all":
                spans = self.assistant_spans(messages, text)
                for start, end in spans[-1:] if train_on == "last" else spans:
                    trained |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        if train_on == "all":
            trained = np.ones(ids.size, dtype=bool)
        if not trained.any():
            raise ConversationError(
                "template failed",
                "the rendering holds no assistant token (does the template render the "
                "assistant's turns, inside its generation markers?)",
            )
        return RenderedConversation(ids=ids, trained=trained)

    def assistant_spans(self, messages: list[dict[str, Any]], text: str) -> list[tuple[int, int]]:
        """`(start, end)` character spans of each assistant turn in `text`, the rendering of
        `messages`: what rendering through the turn adds to rendering up to it."""
        spans = []
        for turn, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self._apply(messages[:turn], tokenize=False, add_generation_prompt=True)
            through = self._apply(messages[: turn + 1], tokenize=False)
            if not (through.startswith(before) and text.startswith(through)):
                raise ConversationError(
                    "template failed",
                    f"rendering the first {turn} messages is not a prefix of rendering more of "
                    "them (the template rewrites earlier turns), so assistant turn "
                    f"{turn + 1} cannot be located; add {{% generation %}} markers to it",
                )
            spans.append((len(before), len(through)))
        return spans

    def _apply(self, messages: list[dict[str, Any]], **options: Any) -> Any:
        try:
            return self._tokenizer.apply_chat_template(
                messages, chat_template=self.template, return_dict=options["tokenize"], **options
            )
        except ConversationError:
            raise
        except Exception as exc:  # a template may raise anything (jinja's raise_exception)
            raise ConversationError("template failed", f"{type(exc).__name__}: {exc}") from None

    def __repr__(self) -> str:
        return (
            f"ChatTokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id}, "
            f"generation_markers={self.has_generation_markers})"
        )


def _last_run(mask: np.ndarray) -> np.ndarray:
    """Only the last run of True in `mask` (the last generation block: user turns lie between
    the assistant's, so two blocks never touch)."""
    last = np.zeros_like(mask)
    where = np.flatnonzero(mask)
    if where.size:
        end = int(where[-1]) + 1
        gaps = np.flatnonzero(~mask[:end])
        start = int(gaps[-1]) + 1 if gaps.size else 0
        last[start:end] = True
    return last


def load_chat_tokenizer(path: Path | str, *, chat_template: Path | None = None) -> ChatTokenizer:
    """A transformers tokenizer from a local folder (as `save_pretrained` writes it), or from the
    folder of a `tokenizer.json` path; `chat_template`: a Jinja file that replaces its own."""
    path = Path(path).expanduser()
    folder = path.parent if path.is_file() else path
    if not folder.is_dir():
        raise DataError(
            f"--tokenizer {str(path)!r}: chat data needs a transformers tokenizer folder "
            "(tokenizer.json and tokenizer_config.json, as save_pretrained writes them)"
        )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise DataError(
            "chat data is rendered with transformers' chat templates: pip install 'plait[hf]'"
        ) from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise DataError(f"{folder} is not a transformers tokenizer folder: {exc}") from None
    template = None
    if chat_template is not None:
        try:
            template = Path(chat_template).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise DataError(f"--chat-template {str(chat_template)!r}: {exc}") from None
    return ChatTokenizer(tokenizer, name=f"{folder.name} (chat template)", chat_template=template)
