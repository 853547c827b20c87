"""`plait data …`: prepare memory-mapped token files from text and inspect prepared ones.

The data modules (and numpy) are imported when a command runs, so `plait --help` stays fast.
"""

from __future__ import annotations

from pathlib import Path

import typer
from rich.table import Table

from plait.tools.output import make_console

app = typer.Typer(
    name="data",
    help="Prepare and inspect the token files training reads.",
    no_args_is_help=True,
)
console = make_console()


@app.command()
def prepare(
    files: list[Path] = typer.Argument(..., help="UTF-8 text files, concatenated in this order"),
    output: Path = typer.Option(..., "--output", "-o", help="directory to write tokens.bin to"),
    tokenizer: str = typer.Option(
        "byte",
        "--tokenizer",
        "-t",
        help="'byte' (UTF-8 bytes, vocab 256) or a Hugging Face tokenizers file (tokenizer.json)",
    ),
) -> None:
    """Tokenize FILES into OUTPUT/tokens.bin and OUTPUT/meta.json."""
    from plait.plugins.data.token_files import DataError, TokenFile, prepare_token_files
    from plait.plugins.data.tokenizer import get_tokenizer

    try:
        directory = prepare_token_files(files, output, tokenizer=get_tokenizer(tokenizer))
        token_file = TokenFile(directory)
    except (DataError, ValueError) as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(1) from None
    meta = token_file.meta
    table = Table(title=f"token files in {directory}", show_footer=True)
    table.add_column("file", footer="total")
    table.add_column("bytes", justify="right", footer=f"{sum(s.bytes for s in meta.sources):,}")
    table.add_column("tokens", justify="right", footer=f"{meta.count:,}")
    for source in meta.sources:
        table.add_row(source.path, f"{source.bytes:,}", f"{source.tokens:,}")
    console.print(table)
    console.print(
        f"tokenizer [bold]{meta.tokenizer}[/bold] (vocab {meta.vocab_size:,}), "
        f"dtype {meta.dtype}, {token_file.nbytes:,} bytes in tokens.bin, "
        f"sha256 {meta.sha256[:16]}…"
    )


@app.command()
def info(
    directory: Path = typer.Argument(..., help="a prepared token directory"),
    verify: bool = typer.Option(False, "--verify", help="re-hash tokens.bin against meta.json"),
) -> None:
    """Show what a prepared token directory holds; --verify also checks its checksum."""
    from plait.plugins.data.token_files import DataError, TokenFile

    try:
        token_file = TokenFile(directory, verify_checksum=verify)
    except DataError as exc:
        console.print(f"[red]error:[/red] {exc}", soft_wrap=True)
        raise typer.Exit(1) from None
    meta = token_file.meta
    table = Table(show_header=False, title=str(token_file.directory))
    for key, value in (
        ("tokens", f"{meta.count:,}"),
        ("dtype", meta.dtype),
        ("bytes", f"{token_file.nbytes:,}"),
        ("tokenizer", f"{meta.tokenizer} (vocab {meta.vocab_size:,})"),
        ("sources", "\n".join(s.path for s in meta.sources)),
        ("sha256", meta.sha256 + (" (verified)" if verify else "")),
    ):
        table.add_row(key, value)
    console.print(table)
