"""`plait data …`: prepare memory-mapped token files from corpora and inspect prepared ones.

The data modules (and numpy, pyarrow, datasets) are imported when a command runs, so
`plait --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from plait.training.output import make_console, print_error

if TYPE_CHECKING:
    from plait.plugins.data.corpus_preparation import PrepareReport
    from plait.plugins.data.token_files import TokenFile

app = typer.Typer(
    name="data",
    help="Prepare and inspect the token files training reads.",
    no_args_is_help=True,
)
console = make_console()


def _separator(value: str | None) -> str | None:
    r"""The separator with `\n`, `\t`, `\\` … understood, so a shell can pass a blank line."""
    if value is None:
        return None
    # Characters beyond latin-1 are escaped first, so unicode_escape gives them back unchanged.
    return value.encode("latin-1", "backslashreplace").decode("unicode_escape")


@app.command()
def prepare(
    files: list[Path] = typer.Argument(
        ...,
        help="corpora, read in this order: .txt, .jsonl, .jsonl.gz, .parquet, or a folder "
        "written by datasets' save_to_disk",
    ),
    output: Path = typer.Option(..., "--output", "-o", help="directory to write tokens.bin to"),
    tokenizer: str = typer.Option(
        "byte",
        "--tokenizer",
        "-t",
        help="'byte' (UTF-8 bytes; plait adds EOS = 256, vocab 257) or a Hugging Face "
        "tokenizers file (tokenizer.json; its own EOS when it has one)",
    ),
    text_field: str = typer.Option(
        "text", "--text-field", help="the field or column holding each document's text"
    ),
    separator: str | None = typer.Option(
        None,
        "--separator",
        help=r"split .txt files into documents at this string (e.g. '\n\n'); default: one "
        "document per file",
    ),
    split: str = typer.Option("train", "--split", help="the split of a saved DatasetDict"),
    workers: int | None = typer.Option(
        None, "--workers", "-j", min=1, help="tokenizing processes; default min(4, CPUs)"
    ),
    chat: bool = typer.Option(
        False,
        "--chat",
        help="rows are conversations: render each through the tokenizer's chat template and "
        "train only on the tokens --train-on selects (--tokenizer: a transformers tokenizer "
        "folder)",
    ),
    messages_field: str = typer.Option(
        "messages",
        "--messages-field",
        help="with --chat: the field or column holding each conversation's list of messages",
    ),
    train_on: str = typer.Option(
        "assistant",
        "--train-on",
        help="with --chat: the tokens trained on: 'assistant' (every assistant turn), 'last' "
        "(the last assistant turn) or 'all'",
    ),
    max_tokens: int | None = typer.Option(
        None,
        "--max-tokens",
        min=2,
        help="with --chat: the longest conversation in tokens, EOS included (the row length, "
        "data.seq_len); longer ones are handled as --too-long says",
    ),
    too_long: str = typer.Option(
        "drop",
        "--too-long",
        help="with --chat: 'drop' a conversation longer than --max-tokens, or 'truncate' it",
    ),
    chat_template: Path | None = typer.Option(
        None, "--chat-template", help="with --chat: a Jinja file replacing the tokenizer's template"
    ),
) -> None:
    """Tokenize the documents of FILES into OUTPUT (tokens.bin, documents.bin, meta.json).

    Every document ends with an EOS token. Rows with no usable text (field missing, not a
    string, empty, invalid JSON) are skipped, counted by reason and listed. With --chat each
    row is a conversation, written as one document with loss_mask.bin beside the tokens;
    conversations that are malformed, have no assistant turn or an unknown role, fail their
    template or are too long are skipped the same way.
    """
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from plait.plugins.data.chat_preparation import prepare_conversations
    from plait.plugins.data.chat_template import load_chat_tokenizer
    from plait.plugins.data.corpus_preparation import default_workers, prepare_documents
    from plait.plugins.data.errors import DataError
    from plait.plugins.data.token_files import TokenFile
    from plait.plugins.data.tokenizer import get_tokenizer

    workers = workers or default_workers()
    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=console,
        transient=True,
    )
    try:
        with progress:
            task = progress.add_task(f"tokenizing on {workers} processes", total=None)
            if chat:
                report = prepare_conversations(
                    files,
                    output,
                    tokenizer=load_chat_tokenizer(tokenizer, chat_template=chat_template),
                    messages_field=messages_field,
                    split=split,
                    train_on=train_on,  # type: ignore[arg-type]  # checked by the callee
                    max_tokens=max_tokens,
                    too_long=too_long,  # type: ignore[arg-type]  # checked by the callee
                    workers=workers,
                    progress=lambda done, total: progress.update(task, completed=done, total=total),
                )
            else:
                report = prepare_documents(
                    files,
                    output,
                    tokenizer=get_tokenizer(tokenizer),
                    text_field=text_field,
                    separator=_separator(separator),
                    split=split,
                    workers=workers,
                    progress=lambda done, total: progress.update(task, completed=done, total=total),
                )
        token_file = TokenFile(report.directory)
    except (DataError, ValueError) as exc:
        print_error(console, exc, soft_wrap=True, highlight=True)
        raise typer.Exit(1) from None
    _print_prepared(report, token_file)


def _print_prepared(report: PrepareReport, token_file: TokenFile) -> None:
    meta = report.meta
    table = Table(title=f"token files in {escape(str(report.directory))}", show_footer=True)
    table.add_column("input", footer="total")
    table.add_column("bytes", justify="right", footer=f"{sum(s.bytes for s in meta.sources):,}")
    table.add_column("documents", justify="right", footer=f"{meta.documents:,}")
    table.add_column("tokens", justify="right", footer=f"{meta.count:,}")
    table.add_column("bad rows", justify="right", footer=f"{report.skipped_total:,}")
    for source in meta.sources:
        table.add_row(
            Text(source.path),
            f"{source.bytes:,}",
            f"{source.documents:,}",
            f"{source.tokens:,}",
            f"{source.skipped_rows:,}",
        )
    console.print(table)
    eos = report.eos
    console.print(
        f"tokenizer [bold]{escape(meta.tokenizer)}[/bold], EOS id {eos.eos_id}"
        + (" (added by plait)" if eos.added else " (the tokenizer's own)")
        + f", vocab {meta.vocab_size:,}, dtype {meta.dtype}, {token_file.nbytes:,} bytes in "
        f"tokens.bin, sha256 {meta.sha256[:16]}…"
    )
    if meta.trained_tokens is not None:
        console.print(
            f"trained on {_trained_share(meta.trained_tokens, meta.count)} (loss_mask.bin)"
        )
    if report.skipped:
        by_reason = ", ".join(f"{reason}: {n:,}" for reason, n in report.skipped.items())
        console.print(f"[yellow]skipped {report.skipped_total:,} bad rows[/yellow] ({by_reason})")
        for bad in report.bad_rows:
            console.print(f"  {bad.describe()}", soft_wrap=True, markup=False)
        if report.skipped_total > len(report.bad_rows):
            console.print(f"  … and {report.skipped_total - len(report.bad_rows):,} more")


def _trained_share(trained: int, count: int) -> str:
    return f"{trained:,} of {count:,} tokens ({trained / max(count, 1):.1%})"


@app.command()
def info(
    directory: Path = typer.Argument(..., help="a prepared token directory"),
    verify: bool = typer.Option(False, "--verify", help="re-hash the files against meta.json"),
    png: Path | None = typer.Option(
        None, "--png", help="also draw the document length histogram to this PNG file"
    ),
) -> None:
    """Show what a prepared token directory holds: documents, tokens, length percentiles and a
    histogram of document lengths; --verify also checks its checksums."""
    from plait.plugins.data.document_stats import histogram_lines, length_stats
    from plait.plugins.data.errors import DataError
    from plait.plugins.data.token_files import TokenFile

    try:
        token_file = TokenFile(directory, verify_checksum=verify)
    except DataError as exc:
        print_error(console, exc, soft_wrap=True, highlight=True)
        raise typer.Exit(1) from None
    meta = token_file.meta
    documents = token_file.documents
    eos = "none" if meta.eos_id is None else str(meta.eos_id)
    rows = [
        ("format", f"version {meta.format_version}"),
        ("tokens", f"{meta.count:,}"),
        (
            "documents",
            f"{documents.count:,}"
            if documents is not None
            else "no boundaries: one token stream"
            + (" (format version 1)" if meta.format_version == 1 else ""),
        ),
        ("dtype", meta.dtype),
        ("bytes", f"{token_file.nbytes:,}"),
        ("tokenizer", f"{meta.tokenizer} (vocab {meta.vocab_size:,}, EOS {eos})"),
        ("sources", "\n".join(s.path for s in meta.sources)),
    ]
    if meta.skipped_rows:
        rows.append(
            ("skipped rows", ", ".join(f"{r}: {n:,}" for r, n in meta.skipped_rows.items()))
        )
    if meta.trained_tokens is not None:
        rows.append(("trained tokens", _trained_share(meta.trained_tokens, meta.count)))
    rows.append(("sha256", meta.sha256 + (" (verified)" if verify else "")))
    table = Table(show_header=False, title=escape(str(token_file.directory)))
    for key, value in rows:
        table.add_row(key, Text(value))
    console.print(table)
    if documents is None:
        if png is not None:
            console.print("[red]error:[/red] --png needs documents; this directory is a stream")
            raise typer.Exit(1)
        return
    stats = length_stats(documents.lengths)
    percentiles = "  ".join(f"p{p} {v:,.0f}" for p, v in stats.percentiles.items())
    console.print(
        f"document length in tokens: min {stats.shortest:,}  {percentiles}  max "
        f"{stats.longest:,}  mean {stats.mean:,.1f}"
    )
    for line in histogram_lines(stats):
        console.print(line, markup=False, highlight=False)
    if png is not None:
        from plait.plugins.data.document_stats import write_histogram_png

        title = f"{token_file.directory.name}: document lengths"
        written = write_histogram_png(stats, png, title=title)
        console.print(f"histogram written to {written}", markup=False)
