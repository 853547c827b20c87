"""Document lengths of a token directory: percentiles and a histogram, as text or as a picture.

`plait data info` prints them; `--png` draws the same histogram with matplotlib. The bins double
in width (1, 2–3, 4–7, 8–15, … tokens), since corpora mix one-line documents with books.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

PERCENTILES = (1, 10, 50, 90, 99)
BAR_WIDTH = 40


@dataclass(frozen=True, slots=True, kw_only=True)
class LengthStats:
    """Lengths in tokens (EOS included) of a directory's documents."""

    documents: int
    tokens: int
    shortest: int
    longest: int
    mean: float
    percentiles: dict[int, float]
    bin_edges: tuple[int, ...]  # bin i holds lengths in [edges[i], edges[i + 1])
    bin_counts: tuple[int, ...]


def length_stats(lengths: np.ndarray) -> LengthStats:
    """Percentiles and a doubling-width histogram of `lengths` (at least one document)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    longest = int(lengths.max())
    top = max(1, int(np.ceil(np.log2(longest + 1))))
    edges = 2 ** np.arange(top + 1, dtype=np.int64)
    counts, _ = np.histogram(lengths, bins=edges)
    values = np.percentile(lengths, PERCENTILES)
    return LengthStats(
        documents=int(lengths.size),
        tokens=int(lengths.sum()),
        shortest=int(lengths.min()),
        longest=longest,
        mean=float(lengths.mean()),
        percentiles={p: float(v) for p, v in zip(PERCENTILES, values, strict=True)},
        bin_edges=tuple(int(e) for e in edges),
        bin_counts=tuple(int(c) for c in counts),
    )


def bin_label(low: int, high: int) -> str:
    """`[low, high)` as the lengths it holds: '1', '2–3', '1,024–2,047'."""
    return f"{low:,}" if high - low == 1 else f"{low:,}–{high - 1:,}"


def histogram_lines(stats: LengthStats) -> list[str]:
    """The histogram as text: one line per non-empty bin span, a bar scaled to the largest."""
    counts = np.array(stats.bin_counts)
    nonzero = np.flatnonzero(counts)
    peak = int(counts.max())
    labels = [
        bin_label(lo, hi) for lo, hi in zip(stats.bin_edges[:-1], stats.bin_edges[1:], strict=True)
    ]
    width = max(len(labels[i]) for i in nonzero)
    lines = []
    for i in range(int(nonzero[0]), int(nonzero[-1]) + 1):
        bar = "█" * (round(BAR_WIDTH * counts[i] / peak) if counts[i] else 0)
        if counts[i] and not bar:
            bar = "▏"  # a bin too small to draw is still shown to exist
        share = counts[i] / stats.documents
        lines.append(f"{labels[i]:>{width}} tokens │{bar:<{BAR_WIDTH}} {counts[i]:,} ({share:.1%})")
    return lines


def _short_count(value: float) -> str:
    """1, 16, 256, 4k, 64k, 1M: tick labels a reader takes in at a glance."""
    for divisor, suffix in ((1 << 20, "M"), (1 << 10, "k")):
        if value >= divisor:
            return f"{value / divisor:g}{suffix}"
    return f"{value:g}"


def write_histogram_png(stats: LengthStats, path: Path | str, *, title: str) -> Path:
    """Draw the length histogram (log-scaled length axis, median and p90/p99 marked) to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; a training node has none
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    edges = np.array(stats.bin_edges)
    figure, axes = plt.subplots(figsize=(8, 4.5), dpi=120)
    try:
        axes.bar(
            edges[:-1],
            stats.bin_counts,
            width=np.diff(edges),
            align="edge",
            color="#4C72B0",
            edgecolor="white",
        )
        axes.set_xscale("log", base=2)
        axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _short_count(value)))
        axes.set_xlabel("document length (tokens, EOS included)")
        axes.set_ylabel("documents")
        axes.set_title(
            f"{title}\n{stats.documents:,} documents · {stats.tokens:,} tokens · mean "
            f"{stats.mean:,.1f}",
            fontsize=11,
        )
        for percentile, style in ((50, "-"), (90, "--"), (99, ":")):
            value = stats.percentiles[percentile]
            axes.axvline(
                value,
                color="#C44E52",
                linestyle=style,
                linewidth=1.2,
                label=f"p{percentile} = {value:,.0f}",
            )
        axes.legend(loc="best", frameon=False, fontsize=9)
        axes.spines[["top", "right"]].set_visible(False)
        figure.tight_layout()
        figure.savefig(path)
    finally:
        plt.close(figure)
    return Path(path)
