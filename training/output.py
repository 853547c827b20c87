"""Where the `plait` commands print: a terminal, or a log file that must read as a log.

In a terminal, rich lays tables out at the terminal's width (and `plait.tools.daemon_tables`
drops the least useful columns of a narrow one). Written to a file or a pipe — Slurm's output
file, `kubectl logs`, `| tee` — there is no width to fit: wrapping would break a figure over two
lines (`12,061 \\ntok/s`) and fitting would cut columns (`tokens/s` as `toke`). There, a line
is never wrapped and a table takes its natural, full width, every column in it.

`COLUMNS`, when set, is the width everywhere (rich's own rule), so a log can still be asked to
fit a given width.
"""

from __future__ import annotations

import os
from typing import Any

from rich.console import Console
from rich.text import Text

# The width of a console writing to a file or a pipe: wide enough that no table or line of
# plait's is ever cut or folded; a table still takes only the width its cells need.
LOG_WIDTH = 100_000
# Section headings in a log are this wide (a terminal's span its full width).
LOG_HEADING_WIDTH = 100


def make_console(**options: Any) -> Console:
    """A rich console for a command's output: the terminal's width in a terminal, no wrapping
    (`LOG_WIDTH`, soft wrap) when stdout is a file or a pipe and `COLUMNS` is not set."""
    console = Console(**options)
    if console.is_terminal or os.environ.get("COLUMNS") or "width" in options:
        return console
    return Console(width=LOG_WIDTH, soft_wrap=True, **options)


def is_log(console: Console) -> bool:
    """Whether `console` writes a log (a file or a pipe at `LOG_WIDTH`)."""
    return not console.is_terminal and console.width >= LOG_WIDTH


def heading(console: Console, title: str) -> None:
    """A section heading: a rule across a terminal, a line of fixed width in a log."""
    if is_log(console):
        line = f"── {title} "
        console.print(line + "─" * max(LOG_HEADING_WIDTH - len(line), 3), highlight=False)
    else:
        console.rule(title)


def print_error(
    console: Console,
    message: object,
    *,
    label: str = "error:",
    soft_wrap: bool = False,
    highlight: bool = False,
) -> None:
    """`error: <message>`: the label in red, the message exactly as it reads.

    A message carries text that is not plait's own: an exception's, a rank's failure line, a
    daemon's gRPC details, a path, a value the operator typed. Such text has square brackets
    of its own (every Gloo error starts with its source location,
    `[/__w/pytorch/.../pair.cc:553]`), which rich markup would read as a tag: a closing one
    raises `MarkupError` in place of the line, `[red]` turns into a colour. So the message goes
    into a `Text`, which is never parsed for markup or emoji codes. Elsewhere the CLI escapes
    such text inside markup with `rich.markup.escape`, puts it in tables as `Text` cells, or
    prints a line without markup of plait's with `markup=False`.
    """
    text = console.render_str(str(message), markup=False, emoji=False, highlight=highlight)
    console.print(Text.assemble((label, "red"), " ", text), soft_wrap=soft_wrap)
