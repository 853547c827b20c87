"""Benchmark: expert parallelism (ep = 2) against replicated experts (ep = 1, DDP) on 2 ranks,
the all-to-all bytes per step measured against the expected, and grouped GEMM against a loop.

    python tools/bench/moe.py [--steps 4] [--seq-len 128] [--groups 8] [--rows 4096]

1. Training the MoE model (8 experts, top-2) on 2 Gloo ranks at ep = 1 and ep = 2, the same
   global batch: tokens/s (median step) and their ratio.
2. At ep = 2, every `all_to_all` is counted by wrapping the rank's `Comm`: bytes this rank sent
   per step, against the expected bytes, `4 exchanges (dispatch, combine, and both backward) ×
   routed rows × dim × 4 bytes` summed over layers and micro-batches; the difference is the
   padding of the equal-split all-to-all (every block padded to the group's largest).
3. `grouped_mm`: the torch reference (a loop of matmuls) against the Triton kernel on CUDA; on
   CPU (no Triton but its interpreter, which is not for timing) against one padded `bmm`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from plait.core.testing import run_distributed


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
        "parallel": {"ep": ep, "transforms": {"ep": "ep"}},
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
    dispatchers = [
        m.run_experts for m in engine.module.modules() if hasattr(m, "tokens_per_expert")
    ]
    generator = torch.Generator().manual_seed(rank)
    share = 8 // engine.mesh.size("dp")
    times, expected = [], 0
    for _ in range(steps):
        tokens = torch.randint(0, 256, (share, seq_len + 1), generator=generator)
        sent.clear()
        start = time.perf_counter()
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        times.append(time.perf_counter() - start)
        # Rows of the last micro-batch's dispatch, as an estimate for every micro-batch.
        rows = sum(getattr(d, "sent_rows", 0) for d in dispatchers)
        expected = 4 * rows * dim * 4 * (share // 2)
    engine.close()
    return {
        "step_s": statistics.median(times),
        "tokens": 8 * seq_len,
        "a2a_bytes": sum(sent),
        "expected_bytes_estimate": expected,
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
    args = parser.parse_args()
    rows = {}
    for ep in (1, 2):
        ranks = run_distributed(_train, 2, ep, args.seq_len, args.steps, timeout=600)
        rows[ep] = ranks[0]
    print(f"{'layout':<8} {'tokens/s':>10} {'a2a MiB/step/rank':>18} {'expected MiB':>13}")
    for ep, r in rows.items():
        print(
            f"ep={ep:<5} {r['tokens'] / r['step_s']:>10.0f} {r['a2a_bytes'] / 2**20:>18.3f} "
            f"{r['expected_bytes_estimate'] / 2**20:>13.3f}"
        )
    print(f"ep2 / ep1 tokens/s: {rows[1]['step_s'] / rows[2]['step_s']:.2f}")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = _grouped(args.groups, args.rows, 128, device)
    peer = "triton" if device == "cuda" else "padded bmm"
    print(
        f"grouped_mm ({device}): loop {g['loop_s'] * 1e3:.2f} ms, {peer} "
        f"{g['peer_s'] * 1e3:.2f} ms, loop / {peer} = {g['loop_s'] / g['peer_s']:.2f}"
    )


if __name__ == "__main__":
    main()
