"""`plait data prepare --chat`: conversations rendered through a tokenizer's own chat template, the
trained tokens equal to transformers' assistant mask where the template marks generation, each
trained span exactly one assistant turn where it does not, and every bad conversation counted by
reason and named. Tokenizers are built locally (`tests/chat_tokenizers.py`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from typer.testing import CliRunner

from plait.plugins.data import DataError, TokenFile
from plait.plugins.data.chat_preparation import prepare_conversations
from plait.plugins.data.chat_template import ChatTokenizer, load_chat_tokenizer
from plait.tools.data_commands import app
from tests.chat_tokenizers import HEADERS, INSTRUCT, MARKED, build_chat_tokenizer

SYSTEM = {"role": "system", "content": "You help."}
CONVERSATIONS = [
    [
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "two plus two is four."},
    ],
    [
        {"role": "user", "content": "hello there, how are you?"},
        {"role": "assistant", "content": "i am fine, thank you."},
        {"role": "user", "content": "name a colour"},
        {"role": "assistant", "content": "red, green, blue."},
    ],
    [
        {"role": "user", "content": "the cat sat on the mat"},
        {"role": "assistant", "content": "and the dog ran to it."},
        {"role": "user", "content": "what is two plus two?"},
        {"role": "assistant", "content": "four."},
        {"role": "user", "content": "thank you"},
        {"role": "assistant", "content": "you are fine."},
    ],
]
# What each template renders of an assistant turn whose text is `content`: by hand, from the
# templates in tests/chat_tokenizers.py, so the check does not reuse the code under test.
TURN_TEXT = {
    "instruct": lambda content: f" {content}</s>",
    "headers": lambda content: f"{content}<|eot_id|>",
}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tokenizers")
    return {
        name: build_chat_tokenizer(root / name, template)
        for name, template in (("marked", MARKED), ("instruct", INSTRUCT), ("headers", HEADERS))
    }


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text(
        "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8"
    )
    return path


def documents(token_file: TokenFile) -> list[tuple[np.ndarray, np.ndarray]]:
    """Each document's ids and trained mask."""
    assert token_file.documents is not None and token_file.loss_mask is not None
    return [
        (
            np.asarray(token_file.tokens[start : start + length], dtype=np.int64),
            np.asarray(token_file.loss_mask[start : start + length], dtype=bool),
        )
        for start, length in zip(
            token_file.documents.starts, token_file.documents.lengths, strict=True
        )
    ]


def trained_runs(tokenizer: ChatTokenizer, ids: np.ndarray, mask: np.ndarray) -> list[str]:
    """The text of each run of consecutive trained tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return [tokenizer.decode(ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def prepare(tmp_path: Path, tokenizer_dir: Path, conversations: list, **options: Any) -> TokenFile:
    tmp_path.mkdir(parents=True, exist_ok=True)
    corpus = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in conversations])
    report = prepare_conversations(
        [corpus], tmp_path / "tokens", tokenizer=load_chat_tokenizer(tokenizer_dir), **options
    )
    assert report.skipped == {}
    return TokenFile(report.directory, verify_checksum=True)


def test_a_marked_template_trains_exactly_transformers_assistant_mask(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tokenizers["marked"]))
    token_file = prepare(tmp_path, tokenizers["marked"], CONVERSATIONS)
    assert load_chat_tokenizer(tokenizers["marked"]).has_generation_markers
    eos = token_file.meta.eos_id
    for (ids, mask), messages in zip(documents(token_file), CONVERSATIONS, strict=True):
        expected = reference.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        assert ids.tolist() == [*expected["input_ids"], eos]
        assert mask.tolist() == [bool(m) for m in expected["assistant_masks"]] + [False]
    assert token_file.meta.trained_tokens < token_file.meta.count / 2


@pytest.mark.parametrize("template", ["instruct", "headers"])
def test_without_markers_each_trained_span_is_one_assistant_turn(
    tokenizers: dict[str, Path], tmp_path: Path, template: str
) -> None:
    tokenizer = load_chat_tokenizer(tokenizers[template])
    assert not tokenizer.has_generation_markers
    token_file = prepare(tmp_path, tokenizers[template], CONVERSATIONS)
    for (ids, mask), messages in zip(documents(token_file), CONVERSATIONS, strict=True):
        turns = [TURN_TEXT[template](m["content"]) for m in messages if m["role"] == "assistant"]
        assert trained_runs(tokenizer, ids, mask) == turns
        # The tokens are the template's rendering, EOS after it, untrained.
        rendered = tokenizer._tokenizer.apply_chat_template(messages, tokenize=False)
        assert tokenizer.decode(ids[:-1]) == rendered
        assert ids[-1] == token_file.meta.eos_id and not mask[-1]


def test_a_system_turn_and_history_stay_context(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    conversation = [SYSTEM, *CONVERSATIONS[2]]
    tokenizer = load_chat_tokenizer(tokenizers["headers"])
    ids, mask = documents(prepare(tmp_path, tokenizers["headers"], [conversation]))[0]
    assert tokenizer.decode(ids).startswith("<|start_header_id|>system<|end_header_id|>\n\nYou")
    assert trained_runs(tokenizer, ids, mask) == [
        "and the dog ran to it.<|eot_id|>",
        "four.<|eot_id|>",
        "you are fine.<|eot_id|>",
    ]


@pytest.mark.parametrize("template", ["marked", "instruct"])
def test_train_on_last_and_all(tokenizers: dict[str, Path], tmp_path: Path, template: str) -> None:
    tokenizer = load_chat_tokenizer(tokenizers[template])
    every = documents(prepare(tmp_path / "a", tokenizers[template], CONVERSATIONS))
    last = documents(prepare(tmp_path / "l", tokenizers[template], CONVERSATIONS, train_on="last"))
    whole = documents(prepare(tmp_path / "w", tokenizers[template], CONVERSATIONS, train_on="all"))
    for (ids, mask), (last_ids, last_mask), (all_ids, all_mask) in zip(
        every, last, whole, strict=True
    ):
        assert np.array_equal(ids, last_ids) and np.array_equal(ids, all_ids)
        assert trained_runs(tokenizer, ids, last_mask) == trained_runs(tokenizer, ids, mask)[-1:]
        assert all_mask.all()  # the EOS too


def test_every_bad_conversation_is_counted_by_reason_and_named(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    good = CONVERSATIONS[0]
    rows: list[Any] = [
        {"messages": good},  # 1
        {"text": "no messages"},  # 2 missing field
        "{not json",  # 3 invalid JSON
        ["a", "list"],  # 4 not an object
        {"messages": "hello"},  # 5 not a list
        {"messages": []},  # 6 empty
        {"messages": [{"role": "user", "content": ["parts"]}]},  # 7 not a message
        {"messages": [{"role": "wizard", "content": "hi"}, *good]},  # 8 unknown role
        {"messages": [{"role": "user", "content": "hi"}]},  # 9 no assistant turn
        {"messages": [SYSTEM, *good]},  # 10 template failed: INSTRUCT has no system role
        {"messages": CONVERSATIONS[2] * 3},  # 11 too long
        {"messages": CONVERSATIONS[1]},  # 12
    ]
    corpus = write_jsonl(tmp_path / "chats.jsonl", rows)
    report = prepare_conversations(
        [corpus],
        tmp_path / "tokens",
        tokenizer=load_chat_tokenizer(tokenizers["instruct"]),
        max_tokens=64,
    )
    reasons = [
        "missing field",
        "invalid JSON",
        "not an object",
        "not a list",
        "empty",
        "not a message",
        "unknown role",
        "no assistant turn",
        "template failed",
        "too long",
    ]
    assert report.skipped == dict.fromkeys(sorted(reasons), 1)
    assert [(bad.row, bad.reason) for bad in report.bad_rows] == list(
        zip(range(2, 12), reasons, strict=True)
    )
    details = " | ".join(bad.describe() for bad in report.bad_rows)
    assert (
        "'wizard'" in details
        and "no system role" in details
        and "more than --max-tokens 64" in details
    )
    token_file = TokenFile(report.directory)
    assert token_file.meta.documents == 2 and token_file.meta.skipped_rows == report.skipped
    assert report.meta.sources[0].skipped_rows == len(reasons)


def test_too_long_conversations_are_cut_when_asked(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    tokenizer = load_chat_tokenizer(tokenizers["instruct"])
    full = documents(prepare(tmp_path / "full", tokenizers["instruct"], CONVERSATIONS))
    cut = documents(
        prepare(
            tmp_path / "cut",
            tokenizers["instruct"],
            CONVERSATIONS,
            max_tokens=24,
            too_long="truncate",
        )
    )
    eos = full[0][0][-1]
    for (ids, mask), (cut_ids, cut_mask) in zip(full, cut, strict=True):
        assert cut_ids.size == min(ids.size, 24) and cut_ids[-1] == eos and not cut_mask[-1]
        assert np.array_equal(cut_ids[:-1], ids[: cut_ids.size - 1])
        assert np.array_equal(cut_mask[:-1], mask[: cut_ids.size - 1])
    assert len(trained_runs(tokenizer, *cut[2])) < len(trained_runs(tokenizer, *full[2]))
    # Cut so short that nothing trained is left: too long all the same.
    corpus = write_jsonl(tmp_path / "one.jsonl", [{"messages": CONVERSATIONS[1]}])
    with pytest.raises(DataError, match="hold no conversation to train on \\(1 too long\\)"):
        prepare_conversations(
            [corpus], tmp_path / "none", tokenizer=tokenizer, max_tokens=4, too_long="truncate"
        )


def test_parquet_and_datasets_folders_give_the_same_tokens(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    import datasets

    table = datasets.Dataset.from_dict({"chat": CONVERSATIONS})
    table.to_parquet(str(tmp_path / "chats.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    tokenizer = load_chat_tokenizer(tokenizers["marked"])
    expected = prepare(tmp_path / "jsonl", tokenizers["marked"], CONVERSATIONS)
    for name in ("chats.parquet", "saved"):
        report = prepare_conversations(
            [tmp_path / name], tmp_path / f"out-{name}", tokenizer=tokenizer, messages_field="chat"
        )
        token_file = TokenFile(report.directory)
        assert np.array_equal(token_file.tokens, expected.tokens), name
        assert np.array_equal(token_file.loss_mask, expected.loss_mask), name


def test_two_processes_write_the_same_bytes(tokenizers: dict[str, Path], tmp_path: Path) -> None:
    one = prepare(tmp_path / "one", tokenizers["headers"], CONVERSATIONS * 3)
    two = prepare(tmp_path / "two", tokenizers["headers"], CONVERSATIONS * 3, workers=2)
    assert one.meta.sha256 == two.meta.sha256
    assert one.meta.loss_mask_sha256 == two.meta.loss_mask_sha256


def test_the_cli_prepares_chat_and_reports_bad_rows(
    tokenizers: dict[str, Path], tmp_path: Path
) -> None:
    corpus = write_jsonl(
        tmp_path / "chats.jsonl",
        [{"messages": m} for m in CONVERSATIONS]
        + [{"messages": [{"role": "user", "content": "hi"}]}],
    )
    out = tmp_path / "tokens"
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "prepare",
            str(corpus),
            "-o",
            str(out),
            "--chat",
            "-t",
            str(tokenizers["marked"]),
            "-j",
            "1",
        ],
        env={"COLUMNS": "200"},
    )
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "skipped 1 bad rows (no assistant turn: 1)" in text
    assert "row 4: no assistant turn (roles: user)" in text
    token_file = TokenFile(out)
    assert f"trained on {token_file.meta.trained_tokens:,} of {token_file.count:,} tokens" in text
    info = runner.invoke(app, ["info", str(out)], env={"COLUMNS": "200"})
    assert info.exit_code == 0 and "trained tokens" in info.output and "version 3" in info.output
    refused = runner.invoke(
        app, ["prepare", str(corpus), "-o", str(tmp_path / "x"), "--chat", "-t", "byte"]
    )
    assert refused.exit_code == 1 and "transformers tokenizer folder" in refused.output
