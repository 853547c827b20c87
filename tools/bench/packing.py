"""Benchmark: packed rows with document masking against padded rows of the same documents.

    python tools/bench/packing.py [--seq-len 256] [--documents 96] [--batch-rows 8]
                                  [--rounds 3] [--size tiny] [--attention-only]

1. Training: one corpus of `documents` documents with lengths drawn from a log-normal around
   T/4 (a realistic mix: many short documents, a tail longer than a row), laid out two ways
   with plait's own planners (`plait.plugins.data.packing`): `first_fit` packing (rows of T
   filled first-fit-decreasing, documents masked from one another) and one document per row
   padded to T (what a loop without packing trains on). Both cut a document longer than a row
   into the same pieces, so both score exactly the same tokens. The built-in Llama trains one
   pass over all rows of each layout, `batch-rows` rows per step, the two layouts alternating
   round by round; printed: document tokens per second (padding excluded) of each, and the
   ratio, per round and as the median. The goal is packed ≥ 1.5× padded.
2. Attention alone, on the packed rows: the kernel facade's attention with the rows' document
   ids against plain causal attention over whole rows (forward + backward), alternating; on
   CUDA the Triton kernel skips the tiles no query may see, on CPU the torch path masks a dense
   score matrix (so there the mask costs time instead of saving it: both are printed).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import numpy as np
import torch

from plait.core.documents import Documents
from plait.core.engine import Engine
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins.data.packing import RowPlan, fill_rows, plan_first_fit, plan_one_per_row

VOCAB = 256


def document_lengths(count: int, seq_len: int, seed: int) -> np.ndarray:
    """Log-normal lengths with median T/4 (σ = 1), at least 2 tokens, at most 3·T."""
    generator = np.random.default_rng(seed)
    lengths = generator.lognormal(mean=np.log(seq_len / 4), sigma=1.0, size=count)
    return np.clip(np.rint(lengths), 2, 3 * seq_len).astype(np.int64)


def layouts(lengths: np.ndarray, seq_len: int, seed: int) -> dict[str, RowPlan]:
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return {
        "packed": plan_first_fit(starts, lengths, seq_len),
        "padded": plan_one_per_row(starts, lengths, seq_len),
    }


def batches(
    plan: RowPlan, tokens: np.ndarray, batch_rows: int
) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    out = []
    for first in range(0, plan.rows, batch_rows):
        rows = np.arange(first, min(plan.rows, first + batch_rows))
        ids, positions, targets = fill_rows(plan.take_rows(rows), tokens, pad_id=0)
        inputs = {"tokens": torch.from_numpy(ids), "positions": torch.from_numpy(positions)}
        out.append((inputs, torch.from_numpy(targets)))
    return out


def _engine(seq_len: int, size: str) -> Engine:
    config: dict[str, Any] = {
        "model": {"name": "llama", "size": size, "overrides": {"max_seq_len": seq_len}},
        "data": {"seq_len": seq_len},
        "train": {"device": "auto", "seed": 0},
        "optimizer": {"lr": 1e-4, "warmup_steps": 0},
        "telemetry": {"enabled": False},
    }
    return Engine(config=config)


def _train_pass(engine: Engine, steps: list[Any]) -> float:
    start = time.perf_counter()
    for batch in steps:
        engine.train_step(batch)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def training(args: argparse.Namespace) -> None:
    lengths = document_lengths(args.documents, args.seq_len, args.seed)
    generator = np.random.default_rng(args.seed + 1)
    tokens = generator.integers(1, VOCAB, size=int(lengths.sum()), dtype=np.int64)
    plans = layouts(lengths, args.seq_len, args.seed)
    steps = {name: batches(plan, tokens, args.batch_rows) for name, plan in plans.items()}
    document_tokens = int(lengths.sum())
    scored = {name: int(sum(int((y != -100).sum()) for _, y in s)) for name, s in steps.items()}
    assert scored["packed"] == scored["padded"], scored
    print(
        f"{args.documents} documents, {document_tokens:,} tokens, lengths median "
        f"{int(np.median(lengths))} (T = {args.seq_len}), max {int(lengths.max())}"
    )
    for name, plan in plans.items():
        print(
            f"  {name}: {plan.rows} rows, {plan.pieces} pieces, padding "
            f"{plan.padding_fraction:.1%}, {len(steps[name])} steps of {args.batch_rows} rows"
        )
    engine = _engine(args.seq_len, args.size)
    for name in plans:  # warm-up: allocator, kernels, first-step FLOP counting
        _train_pass(engine, steps[name][:1])
    ratios = []
    print(f"{'round':>5} {'packed tok/s':>13} {'padded tok/s':>13} {'ratio':>7}")
    for round_index in range(args.rounds):
        order = ("packed", "padded") if round_index % 2 == 0 else ("padded", "packed")
        seconds = {name: _train_pass(engine, steps[name]) for name in order}
        rate = {name: document_tokens / seconds[name] for name in seconds}
        ratios.append(rate["packed"] / rate["padded"])
        print(
            f"{round_index:>5} {rate['packed']:>13,.0f} {rate['padded']:>13,.0f} "
            f"{ratios[-1]:>6.2f}x"
        )
    print(f"median packed / padded: {statistics.median(ratios):.2f}x (goal >= 1.5x)")


def attention(args: argparse.Namespace) -> None:
    lengths = document_lengths(args.documents, args.seq_len, args.seed)
    starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    packed = plan_first_fit(starts, lengths, args.seq_len)
    # First-fit-decreasing fills its first rows with the longest documents: take rows at random.
    chosen = np.random.default_rng(args.seed).permutation(packed.rows)[: args.batch_rows]
    plan = packed.take_rows(np.sort(chosen))
    _, positions, _ = fill_rows(plan, np.zeros(int(lengths.sum()), dtype=np.int64), pad_id=0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    documents = Documents.from_positions(torch.from_numpy(positions).to(device))
    kernels = Kernels(Plugins.create(autoload=False))
    attend = kernels.get("attention", device, dtype)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    shape = (plan.rows, 8, args.seq_len, 64)
    q, k, v = (
        torch.randn(shape, generator=generator, device=device, dtype=dtype).requires_grad_()
        for _ in range(3)
    )

    def run(document_ids: torch.Tensor | None) -> float:
        start = time.perf_counter()
        for _ in range(args.repeats):
            out = attend(q, k, v, causal=True, document_ids=document_ids)
            out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - start) / args.repeats

    run(documents.document_ids), run(None)  # warm-up (and the Triton tile search on CUDA)
    masked, causal = [], []
    for round_index in range(args.rounds):
        pair = [("masked", documents.document_ids), ("causal", None)]
        for name, ids in pair if round_index % 2 == 0 else reversed(pair):
            (masked if name == "masked" else causal).append(run(ids))
    pairs = documents.attention_pairs()
    whole = plan.rows * args.seq_len * (args.seq_len + 1) // 2
    print(
        f"attention fwd+bwd, {plan.rows} packed rows of {args.seq_len} on {device.type} "
        f"({getattr(attend, '__module__', type(attend).__module__)}): "
        f"document-masked {statistics.median(masked) * 1e3:.2f} ms, full causal "
        f"{statistics.median(causal) * 1e3:.2f} ms, ratio causal / masked "
        f"{statistics.median(causal) / statistics.median(masked):.2f}x; the documents hold "
        f"{pairs / whole:.1%} of the causal (query, key) pairs"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--documents", type=int, default=96)
    parser.add_argument("--batch-rows", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attention-only", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    if not args.attention_only:
        training(args)
    attention(args)


if __name__ == "__main__":
    main()
