"""Terminal tables of the daemon commands, laid out for the width they are printed at.

A table is a list of `Column`s (a header with its unit, and how to read a cell from a row)
and the rows. Below `NARROW_WIDTH` columns a table keeps to what a person needs on a small
terminal: columns with nothing to show are dropped, so are columns marked `wide_only`, and
job ids are shortened to the shortest form that still tells the jobs apart. Cells carry bare
numbers, the unit is in the header ("step ms", not "123.4 ms" in every cell), so columns stay
narrow enough that rich never has to cut a word into `tok…`. A cell is plain text: hosts, job
ids, device names and error details come from the daemons and are shown as they are; only a
column marked `markup` (its cells plait's own figures) styles them with rich markup.

To add a column to a view, add a `Column` to its list; nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

from rich.cells import cell_len
from rich.table import Table
from rich.text import Text

NARROW_WIDTH = 120  # below this many terminal columns, tables are compacted
EMPTY_CELLS = frozenset({"", "-"})
SHORT_JOB_ID = 12  # longest job id shown unshortened on a narrow terminal
WRAPPED_MIN_WIDTH = 14  # a free-text column is given at least this many characters
CELL_OVERHEAD = 3  # a cell's padding and its border

Row = TypeVar("Row")


@dataclass(frozen=True, slots=True)
class Column(Generic[Row]):
    """One column: its header (unit included) and the text of its cell for a row."""

    header: str
    cell: Callable[[Row], str]  # plain text, or rich markup when `markup`
    justify: Literal["left", "right", "center"] = "right"
    wide_only: bool = False  # shown only at NARROW_WIDTH columns or more
    keep_empty: bool = False  # a key column: shown even when empty, never dropped to fit
    wraps: bool = False  # free text (lists, explanations): wraps inside its cell
    priority: int = 1  # when a table is too wide, the lowest go first (rightmost first)
    narrow_header: str = ""  # a shorter header for below NARROW_WIDTH columns
    # Cells are rich markup (plait's own styling of its own figures); otherwise they are text
    # shown as it is, brackets included, since it may come from outside plait.
    markup: bool = False

    def title(self, width: int) -> str:
        return self.narrow_header if self.narrow_header and is_narrow(width) else self.header


def is_narrow(width: int) -> bool:
    return width < NARROW_WIDTH


def build_table(
    title: str, columns: Sequence[Column[Row]], rows: Iterable[Row], width: int
) -> Table:
    """A rich table of `rows`, with the columns that fit a terminal `width` wide.

    Figures are never cut ("tok…"): a column of figures is as wide as its widest cell or
    header; free-text columns wrap; if the table is still too wide, columns go by priority.
    """
    rows = list(rows)
    cells = [[_cell_text(column, row) for column in columns] for row in rows]
    keep = [
        i
        for i, column in enumerate(columns)
        if not is_narrow(width)
        or (
            not column.wide_only
            and (column.keep_empty or not rows or any(r[i].plain not in EMPTY_CELLS for r in cells))
        )
    ]
    natural = [
        max([_cell_len(Text.from_markup(column.title(width)))] + [_cell_len(r[i]) for r in cells])
        for i, column in enumerate(columns)
    ]
    need = [
        min(natural[i], WRAPPED_MIN_WIDTH) if column.wraps else natural[i]
        for i, column in enumerate(columns)
    ]
    while sum(need[i] + CELL_OVERHEAD for i in keep) + 1 > width:
        droppable = [i for i in keep if not columns[i].keep_empty]
        if not droppable:
            break
        keep.remove(min(droppable, key=lambda i: (columns[i].priority, -i)))
    table = Table(title=title)
    for i in keep:
        column = columns[i]
        if column.wraps:
            table.add_column(column.title(width), justify=column.justify, overflow="fold")
        else:
            # no_wrap and a minimum width: a figure split or cut reads as another figure.
            table.add_column(
                column.title(width), justify=column.justify, no_wrap=True, min_width=need[i]
            )
    for row in cells:
        table.add_row(*(row[i] for i in keep))
    return table


def _cell_text(column: Column[Row], row: Row) -> Text:
    text = column.cell(row)
    return Text.from_markup(text) if column.markup else Text(text)


def _cell_len(text: Text) -> int:
    return max((cell_len(line) for line in text.plain.split("\n")), default=0)


def short_job_ids(job_ids: Iterable[str], width: int) -> dict[str, str]:
    """job id -> the label shown for it: the id itself on a wide terminal or when short,
    else its head and tail around an ellipsis, long enough to keep every id apart.

    Head and tail both: a UUID differs from another in its first characters, a default id
    made of a config name and a start time in its last ones.
    """
    ids = sorted(set(job_ids))
    if not is_narrow(width):
        return {job_id: job_id for job_id in ids}
    labels: dict[str, str] = {}
    long_ids = [job_id for job_id in ids if len(job_id) > SHORT_JOB_ID]
    for job_id in ids:
        if job_id not in long_ids:
            labels[job_id] = job_id
    for keep in range(4, max((len(j) for j in long_ids), default=0)):
        candidates = {job_id: _abbreviate(job_id, keep) for job_id in long_ids}
        shown = [*candidates.values(), *labels.values()]
        if len(set(shown)) == len(shown):
            return {**labels, **candidates}
    return {**labels, **{job_id: job_id for job_id in long_ids}}


def _abbreviate(job_id: str, keep: int) -> str:
    head, tail = (keep + 1) // 2 + 2, keep // 2 + 2
    if head + tail + 1 >= len(job_id):
        return job_id
    return f"{job_id[:head]}…{job_id[-tail:]}"


def format_bytes(value: float) -> str:
    """Bytes in B / KiB / MiB / GiB ("-" when negative: unknown)."""
    if value < 0:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return str(value)


def milliseconds(seconds: float) -> str:
    return f"{seconds * 1e3:.1f}"


def percent(fraction: float) -> str:
    """A 0..1 fraction as a bare percentage ("-" when negative: unknown)."""
    return "-" if fraction < 0 else f"{fraction * 100:.0f}"
