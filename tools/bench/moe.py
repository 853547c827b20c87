"""Benchmark: expert parallelism (ep = 2) against replicated experts (ep = 1, DDP) on 2 ranks,
the all-to-all bytes per step measured against the expected, and grouped GEMM against a loop.

    python tools/bench/moe.py [--steps 4] [--seq-len 128] [--groups 8] [--rows 4096] [--rounds 2]

1. Training the MoE model (8 experts, top-2) on 2 Gloo ranks at ep = 1 and ep = 2, the same
   global batch, the two layouts alternating `--rounds` times: tokens/s (median over rounds of
   the slower rank's median step) and their ratio.
2. At ep = 2, every `all_to_all` is counted by wrapping the rank's `Comm`: bytes sent per step
   over both ranks, against the expected `4 exchanges (dispatch, combine and their backward) ×
   assignments × dim × 4 bytes`, assignments = global batch × seq_len × top_k × MoE layers
   (dropless): the variable-split all-to-all sends exactly the routed rows. Beside it, what an
   equal-split exchange would send (every (source, destination) block padded to the largest in
   the group, what plait did before split sizes), from the same steps' count matrices.
3. `grouped_mm`: the torch reference (a loop of matmuls) against the Triton kernel on CUDA; on
   CPU (no Triton but its interpreter, which is not for timing) against one padded `bmm`.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from typing import Any

import torch

from plait.testing.distributed import run_distributed


def _config(ep: int, seq_len: int) -> dict[str, Any]:
    return {
        "model": {
            "name": "moe",
            "size": "tiny",
            "overrides": {"dim": 128, "num_experts": 8, "top_k": 2, "expert_hidden_dim": 256,
                          "max_seq_len": seq_len},
        },
        "data": {"seq_len": seq_len},
        "train": {"global_batch_size": 8, "micro_batch_size": 2, "seed": 0, "device": "cpu"},
        "optimizer": {"warmup_steps": 0},
        "parallel": {"ep": ep, "ep_strategy": "ep"},
        "telemetry": {"enabled": False},
    }  # fmt: skip


def _train(rank: int, world: int, ep: int, seq_len: int, steps: int) -> dict[str, Any]:
    del world
    from plait.core.engine import Engine

    engine = Engine(config=_config(ep, seq_len))
    sent: list[int] = []
    issue = engine.comm.all_to_all

    def counting(output: torch.Tensor, input: torch.Tensor, **kwargs: Any) -> Any:
        sent.append(input.numel() * input.element_size())
        return issue(output, input, **kwargs)

    engine.comm.all_to_all = counting  # type: ignore[method-assign]
    dim = engine.model_config.dim
    padded_rows = [0]  # rows an equal-split exchange would have sent, this rank
    for layer in engine.module.modules():
        dispatch = getattr(layer, "run_experts", None)
        if hasattr(dispatch, "gather_counts"):

            def gather(counts: torch.Tensor, _inner: Any = dispatch.gather_counts) -> Any:
                matrix = _inner(counts)
                size, local = len(matrix), len(matrix[0]) // len(matrix)
                largest = max(sum(row[d * local : (d + 1) * local]) for row in matrix
                              for d in range(size))  # fmt: skip
                padded_rows[0] += 4 * size * largest  # dispatch, combine and their backward
                return matrix

            dispatch.gather_counts = gather
    generator = torch.Generator().manual_seed(rank)
    share = 8 // engine.mesh.size("dp")
    times, sent_per_step, padded_per_step = [], [], []
    for _ in range(steps):
        tokens = torch.randint(0, 256, (share, seq_len + 1), generator=generator)
        sent.clear()
        padded_rows[0] = 0
        start = time.perf_counter()
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        times.append(time.perf_counter() - start)
        sent_per_step.append(sum(sent))
        padded_per_step.append(padded_rows[0] * dim * 4)
    config = engine.model_config
    assignments = 8 * seq_len * config.top_k * config.num_moe_layers  # dropless, per step
    engine.close()
    return {
        "step_s": statistics.median(times),
        "tokens": 8 * seq_len,
        "a2a_bytes": statistics.mean(sent_per_step),
        "padded_bytes": statistics.mean(padded_per_step),
        "expected_bytes": 4 * assignments * dim * 4 if ep > 1 else 0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _grouped(groups: int, rows: int, dim: int, device: str) -> dict[str, float]:
    from plait.plugins.kernels_torch.grouped_gemm import grouped_mm as loop

    counts = torch.distributions.Multinomial(rows, torch.ones(groups)).sample().long()
    x = torch.randn(rows, dim, device=device)
    weight = torch.randn(groups, 4 * dim, dim, device=device)

    def timed(fn: Any) -> float:
        fn()
        samples = []
        for _ in range(5):
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            if device == "cuda":
                torch.cuda.synchronize()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    result = {"loop_s": timed(lambda: loop(x, weight, counts))}
    if device == "cuda":
        from plait.plugins.kernels_triton.grouped_gemm import grouped_mm as triton_mm

        result["peer_s"] = timed(lambda: triton_mm(x, weight, counts))
    else:
        longest = int(counts.max())
        padded = torch.zeros(groups, longest, dim)

        def bmm() -> torch.Tensor:
            for g, piece in enumerate(x.split(counts.tolist())):
                padded[g, : piece.shape[0]] = piece
            return torch.bmm(padded, weight.transpose(1, 2))

        result["peer_s"] = timed(bmm)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2, help="ep1/ep2 runs, alternating")
    args = parser.parse_args()
    step_s: dict[int, list[float]] = {1: [], 2: []}
    rows: dict[int, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):  # alternate the layouts so load drifts hit both alike
        for ep in (1, 2):
            rows[ep] = run_distributed(_train, 2, ep, args.seq_len, args.steps, timeout=600)
            step_s[ep].append(max(r["step_s"] for r in rows[ep]))
    print(f"{'layout':<8} {'tokens/s':>10} {'a2a MiB/step':>13} {'expected MiB':>13} "
          f"{'equal-split MiB':>16} {'rank peak RSS MiB':>18}")  # fmt: skip
    for ep, ranks in rows.items():
        tokens_s = ranks[0]["tokens"] / statistics.median(step_s[ep])
        sent = sum(r["a2a_bytes"] for r in ranks) / 2**20
        padded = sum(r["padded_bytes"] for r in ranks) / 2**20
        print(
            f"ep={ep:<5} {tokens_s:>10.0f} {sent:>13.3f} "
            f"{ranks[0]['expected_bytes'] / 2**20:>13.3f} {padded:>16.3f} "
            f"{max(r['peak_rss_mib'] for r in ranks):>18.0f}"
        )
    sent = sum(r["a2a_bytes"] for r in rows[2])
    print(
        f"ep2 / ep1 tokens/s: {statistics.median(step_s[1]) / statistics.median(step_s[2]):.2f}"
        f"; ep2 all-to-all bytes measured / expected: {sent / rows[2][0]['expected_bytes']:.4f}"
        f"; equal-split / measured: {sum(r['padded_bytes'] for r in rows[2]) / sent:.3f}"
    )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = _grouped(args.groups, args.rows, 128, device)
    peer = "triton" if device == "cuda" else "padded bmm"
    print(
        f"grouped_mm ({device}): loop {g['loop_s'] * 1e3:.2f} ms, {peer} "
        f"{g['peer_s'] * 1e3:.2f} ms, loop / {peer} = {g['loop_s'] / g['peer_s']:.2f}"
    )


if __name__ == "__main__":
    main()
