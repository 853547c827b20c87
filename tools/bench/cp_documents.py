"""Benchmark: how evenly ring attention's work falls on the ring positions for packed rows, with
the load-balanced zig-zag layout (2·R chunks, position j holds j and 2·R − 1 − j) against one
contiguous chunk per position.

    python -m plait.tools.bench.cp_documents [--seq-len 4096] [--rows 32] [--sigma 1.0]

Rows are filled with documents whose lengths are log-normal with median T/4 (the last one cut to
fit). Each ring position's work is what the ring's own `AttentionWork` counts in forward: the
unmasked (same document, causal) score entries of every block it computes, over the blocks
`block_pairs` keeps (the ring's own skipping of blocks that share no document). Prints, per ring
degree and layout, the busiest position's work over the mean: for all the rows together (one
micro-batch of every row), averaged over single rows (micro-batches of one row), and per ring
step (Σ over steps of the busiest position's work / Σ of the mean, single rows: the ring's
positions wait for each other's blocks at every step). The last column is what a per-document
zig-zag would add in padding (every document padded to a multiple of 2·R tokens).
Nothing is timed: the work is counted, so the figures are the same on any machine.
"""

from __future__ import annotations

import argparse
import math

import torch

from plait.core.documents import Documents
from plait.core.transforms import ContextParallelism
from plait.plugins.context_parallel.ring import AttentionWork, RingDocuments, block_pairs


def packed_row(seq_len: int, sigma: float, generator: torch.Generator) -> list[int]:
    """Document lengths log-normal around seq_len / 4, filling one row."""
    lengths: list[int] = []
    while sum(lengths) < seq_len:
        draw = math.exp(math.log(seq_len / 4) + sigma * float(torch.randn(1, generator=generator)))
        lengths.append(max(1, min(round(draw), seq_len - sum(lengths))))
    return lengths


def ring_work(documents: Documents, ring_degree: int, balanced: bool) -> list[list[int]]:
    """Each ring position's counted forward attention work at each ring step (heads =
    head_dim = 1)."""
    layouts = [
        ContextParallelism(
            degree=ring_degree,
            rank=p,
            strategy="ring",
            ring_degree=ring_degree,
            load_balanced=balanced,
        )
        for p in range(ring_degree)
    ]
    chunks = RingDocuments.of(documents.document_ids, layouts[0].num_chunks)
    length = documents.seq_len // layouts[0].num_chunks
    shape = torch.empty(documents.rows, 1, length, 1, device="meta")
    work = []
    for layout in layouts:
        query_chunks = layout.ring_chunks(layout.ring_rank)
        steps = []
        for step in range(ring_degree):
            counter = AttentionWork()
            key_chunks = layout.ring_chunks((layout.ring_rank - step) % ring_degree)
            for a, b, causal in block_pairs(query_chunks, key_chunks, chunks):
                counter.add(
                    shape,
                    causal,
                    chunks.chunk_ids[query_chunks[a]],
                    chunks.chunk_ids[key_chunks[b]],
                )
            steps.append(counter.flops)
        work.append(steps)
    return work


def imbalance(work: list[int]) -> float:
    return max(work) / (sum(work) / len(work))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--sigma", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(args.seed)
    rows = [packed_row(args.seq_len, args.sigma, generator) for _ in range(args.rows)]
    counts = [len(row) for row in rows]
    print(
        f"T = {args.seq_len}, {args.rows} rows, document lengths log-normal (median T/4, "
        f"sigma {args.sigma}): {sum(counts) / len(counts):.1f} documents per row"
    )
    print("ring  layout      all rows  one row  per ring step  per-doc zig-zag padding")
    for ring_degree in (2, 4, 8):
        padding = sum(-n % (2 * ring_degree) for row in rows for n in row) / (
            args.seq_len * args.rows
        )
        for balanced, name in ((True, "zig-zag"), (False, "contiguous")):
            totals = [0] * ring_degree
            per_row, per_step = [], []
            for row in rows:
                positions = torch.cat([torch.arange(n) for n in row]).unsqueeze(0)
                work = ring_work(Documents.from_positions(positions), ring_degree, balanced)
                mine = [sum(steps) for steps in work]
                totals = [t + w for t, w in zip(totals, mine, strict=True)]
                per_row.append(imbalance(mine))
                by_step = list(zip(*work, strict=True))
                busiest = sum(max(step) for step in by_step)
                per_step.append(busiest / (sum(mine) / ring_degree))
            print(
                f"{ring_degree:<5} {name:<11} {imbalance(totals):>8.3f}"
                f"  {sum(per_row) / len(per_row):>7.3f}  {sum(per_step) / len(per_step):>13.3f}"
                f"  {f'{padding:>23.2%}' if balanced else ''}"
            )


if __name__ == "__main__":
    main()
