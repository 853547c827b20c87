"""Conversation readers: the `messages` of each row of JSON Lines, Parquet or a `datasets` folder.

    for batch in read_conversations(Path("chats.jsonl"), messages_field="messages"):
        batch.records    # Conversation(source, row, messages) or BadRow(source, row, reason)

A row holds one conversation: a list of messages, each an object with a `role` (one of
`ROLES`) and a string `content`, as transformers' chat templates take them (other keys, such as
`tool_calls`, are passed through). The files are read by `corpus_readers`' field readers, so rows
are numbered, batched and reported exactly as text rows are; a row that holds no usable
conversation is a `BadRow` with one of these reasons:

- `missing field`, `invalid JSON`, `not an object`: as for text rows;
- `not a list`: the field is not a list of messages (`empty`: a list of none);
- `not a message`: a message is not an object with a string `role` and string `content`;
- `unknown role`: a role outside `ROLES`;
- `no assistant turn`: nothing to train on.

What rendering can still find wrong (the template fails, the conversation is too long) is
reported by `chat_template` with the same `BadRow`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from plait.plugins.data.corpus_readers import (
    BadRow,
    ReadBatch,
    read_datasets_field,
    read_jsonl_field,
    read_parquet_field,
)
from plait.plugins.data.errors import DataError

# The roles chat templates know (OpenAI's and transformers' vocabulary; `developer` is the newer
# name of `system`, `tool` a tool's result).
ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet", "a datasets save_to_disk folder")


@dataclass(frozen=True, slots=True)
class Conversation:
    """One row's messages, checked to be a list of role/content objects with an assistant."""

    source: str
    row: int
    messages: list[dict[str, Any]]

    def chars(self) -> int:
        return sum(len(message["content"]) for message in self.messages)


def read_conversations(
    path: Path, *, messages_field: str = "messages", split: str = "train"
) -> Iterator[ReadBatch]:
    """The conversations of `path`, by its suffix (or a folder); a `.txt` file or an unknown
    kind is a `DataError`."""
    name = path.name.lower()
    if path.is_dir():
        return read_datasets_field(
            path, field=messages_field, split=split, check=check_messages, check_column=_check_list
        )
    if name.endswith((".jsonl", ".jsonl.gz")):
        return read_jsonl_field(path, field=messages_field, check=check_messages)
    if name.endswith(".parquet"):
        return read_parquet_field(
            path, field=messages_field, check=check_messages, check_column=_check_list
        )
    raise DataError(
        f"input {str(path)!r}: conversations are read from {', '.join(CHAT_SUFFIXES)}, "
        "one conversation per row"
    )


def check_messages(
    source: str, row: int, value: Any, *, present: bool = True
) -> Conversation | BadRow:
    """A `Conversation` of one row's messages, or the reason it holds none."""
    if not present:
        return BadRow(source, row, "missing field")
    if value is None:
        return BadRow(source, row, "missing field", "null")
    if not isinstance(value, list):
        return BadRow(source, row, "not a list", type(value).__name__)
    if not value:
        return BadRow(source, row, "empty")
    messages = []
    for turn, message in enumerate(value, start=1):
        if not isinstance(message, dict):
            return BadRow(source, row, "not a message", f"message {turn} is a {type(message)}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not isinstance(content, str):
            return BadRow(
                source,
                row,
                "not a message",
                f"message {turn} needs a string role and content, has role "
                f"{type(role).__name__} and content {type(content).__name__}",
            )
        if role not in ROLES:
            return BadRow(
                source, row, "unknown role", f"message {turn}: {role!r}, not one of {ROLES}"
            )
        # Parquet and datasets give every struct field to every message, None where a row had
        # none; a JSON row has only its own keys, and templates see both alike this way.
        messages.append({key: v for key, v in message.items() if v is not None})
    if not any(message["role"] == "assistant" for message in messages):
        roles = ", ".join(message["role"] for message in messages)
        return BadRow(source, row, "no assistant turn", f"roles: {roles}")
    return Conversation(source, row, messages)


def _check_list(schema: Any, field: str, source: str) -> None:
    import pyarrow as pa

    names = list(schema.names)
    if field not in names:
        raise DataError(
            f"input {source!r} has no column {field!r}; its columns are {names}: name the "
            "messages column with --messages-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)):
        raise DataError(
            f"column {field!r} of {source!r} holds {kind}, not conversations (a list of "
            "{role, content} structs)"
        )
