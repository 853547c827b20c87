"""Benchmark the Triton kernels against torch eager and `torch.compile` of the torch reference.

    python tools/bench/kernels.py [--dtype bfloat16] [--ops attention,rms_norm] [--no-compile]

On a CUDA device every op is timed forward and forward+backward (AdamW: one step) with CUDA
events (`triton.testing.do_bench`, median of repetitions), and the table reports milliseconds,
achieved TF/s (from the op's analytic FLOPs) and GB/s (from the bytes the op must move at
least once), and each provider's speed-up over torch eager in the same run. Without a GPU the
kernels could only run under the Triton interpreter, which is a correctness tool, not a
performance target: the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

PROVIDERS: tuple[str, ...] = ("torch", "torch.compile", "triton")


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One op at one shape: how to build its inputs, and the work it does per call."""

    op: str
    shape: str
    make_inputs: Callable[[torch.dtype], tuple[list[torch.Tensor], dict[str, Any]]]
    forward_flops: float
    forward_bytes: Callable[[int], float]  # element size -> bytes
    backward_flops: float = 0.0
    backward_bytes: Callable[[int], float] = lambda _: 0.0
    has_backward: bool = True


def _randn(*shape: int, dtype: torch.dtype, grad: bool = True) -> torch.Tensor:
    return torch.randn(*shape, device="cuda", dtype=dtype).requires_grad_(grad)


def cases(tokens: int, hidden: int, ffn: int, vocab: int, seq: int, heads: int) -> list[Case]:
    """Llama-7B-like shapes: `tokens` rows through norms/MLP, attention over `seq`."""
    batch = max(1, tokens // seq)
    head_dim = hidden // heads
    kv_heads = max(1, heads // 4)
    rows_x_hidden = tokens * hidden
    attention_fwd = 4.0 * batch * heads * seq * seq * head_dim * 0.5  # causal half
    qkvo = batch * seq * head_dim * (2 * heads + 2 * kv_heads)
    adamw_params = 50_000_000
    return [
        Case(
            op="rms_norm", shape=f"{tokens}×{hidden}",
            make_inputs=lambda dt: ([_randn(tokens, hidden, dtype=dt), _randn(hidden, dtype=dt)],
                                    {"eps": 1e-5}),
            forward_flops=4.0 * rows_x_hidden, forward_bytes=lambda es: 2.0 * rows_x_hidden * es,
            backward_flops=8.0 * rows_x_hidden, backward_bytes=lambda es: 3.0 * rows_x_hidden * es,
        ),
        Case(
            op="layer_norm", shape=f"{tokens}×{hidden}",
            make_inputs=lambda dt: ([_randn(tokens, hidden, dtype=dt), _randn(hidden, dtype=dt),
                                     _randn(hidden, dtype=dt)], {"eps": 1e-5}),
            forward_flops=7.0 * rows_x_hidden, forward_bytes=lambda es: 2.0 * rows_x_hidden * es,
            backward_flops=10.0 * rows_x_hidden,
            backward_bytes=lambda es: 3.0 * rows_x_hidden * es,
        ),
        Case(
            op="swiglu", shape=f"{tokens}×{ffn}",
            make_inputs=lambda dt: ([_randn(tokens, ffn, dtype=dt), _randn(tokens, ffn, dtype=dt)],
                                    {}),
            forward_flops=6.0 * tokens * ffn, forward_bytes=lambda es: 3.0 * tokens * ffn * es,
            backward_flops=10.0 * tokens * ffn, backward_bytes=lambda es: 5.0 * tokens * ffn * es,
        ),
        Case(
            op="bias_gelu", shape=f"{tokens}×{ffn}",
            make_inputs=lambda dt: ([_randn(tokens, ffn, dtype=dt), _randn(ffn, dtype=dt)], {}),
            forward_flops=10.0 * tokens * ffn, forward_bytes=lambda es: 2.0 * tokens * ffn * es,
            backward_flops=16.0 * tokens * ffn, backward_bytes=lambda es: 3.0 * tokens * ffn * es,
        ),
        Case(
            op="rope", shape=f"{batch}×{seq}×{heads}×{head_dim}",
            make_inputs=lambda dt: (
                [_randn(batch, seq, heads, head_dim, dtype=dt)],
                {"cos": torch.rand(seq, head_dim // 2, device="cuda").cos(),
                 "sin": torch.rand(seq, head_dim // 2, device="cuda").sin()},
            ),
            forward_flops=3.0 * rows_x_hidden, forward_bytes=lambda es: 2.0 * rows_x_hidden * es,
            backward_flops=3.0 * rows_x_hidden, backward_bytes=lambda es: 2.0 * rows_x_hidden * es,
        ),
        Case(
            op="softmax_cross_entropy", shape=f"{tokens}×{vocab}",
            make_inputs=lambda dt: (
                [_randn(tokens, vocab, dtype=dt)],
                {"targets": torch.randint(0, vocab, (tokens,), device="cuda")},
            ),
            # Read the logits, write their gradient: the least any implementation must move.
            forward_flops=5.0 * tokens * vocab, forward_bytes=lambda es: 2.0 * tokens * vocab * es,
            backward_flops=tokens * vocab, backward_bytes=lambda es: 2.0 * tokens * vocab * es,
        ),
        Case(
            op="attention", shape=f"b{batch} h{heads}/{kv_heads} s{seq} d{head_dim}",
            make_inputs=lambda dt: (
                [_randn(batch, heads, seq, head_dim, dtype=dt),
                 _randn(batch, kv_heads, seq, head_dim, dtype=dt),
                 _randn(batch, kv_heads, seq, head_dim, dtype=dt)],
                {"causal": True},
            ),
            # FlashAttention-2 convention: the backward does 2.5× the forward's matmul work.
            forward_flops=attention_fwd, forward_bytes=lambda es: qkvo * es,
            backward_flops=2.5 * attention_fwd, backward_bytes=lambda es: 2.0 * qkvo * es,
        ),
        Case(
            op="adamw_step", shape=f"{adamw_params / 1e6:.0f}M params",
            make_inputs=lambda dt: (
                [torch.randn(adamw_params, device="cuda", dtype=dt) for _ in range(4)],
                {"step": 10, "lr": 1e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8,
                 "weight_decay": 0.1},
            ),
            # Read param, grad and both moments; write param and both moments.
            forward_flops=12.0 * adamw_params, forward_bytes=lambda es: 7.0 * adamw_params * es,
            has_backward=False,
        ),
    ]  # fmt: skip


def _call(op: str, fn: Callable[..., Any], tensors: list[torch.Tensor], kw: dict[str, Any]) -> Any:
    if op == "adamw_step":
        params, grads, exp_avgs, exp_avg_sqs = tensors
        return fn([params], [grads], [exp_avgs], [exp_avg_sqs], **kw)
    if op == "softmax_cross_entropy":
        return fn(tensors[0], kw["targets"])
    if op == "rope":
        return fn(tensors[0], kw["cos"], kw["sin"])
    if op in ("rms_norm", "layer_norm"):
        return fn(*tensors, kw["eps"])
    if op == "attention":
        return fn(*tensors, causal=kw["causal"])
    return fn(*tensors)


def implementations(op: str, *, with_compile: bool) -> dict[str, Callable[..., Any]]:
    import plait.plugins.kernels_triton as kernels_triton
    from plait.plugins.kernels_torch.ops import OPS

    found = {"torch": OPS[op], "triton": kernels_triton.load_kernel(op)}
    if with_compile:
        found["torch.compile"] = torch.compile(OPS[op], dynamic=False)
    return found


def time_case(case: Case, dtype: torch.dtype, *, with_compile: bool) -> list[dict[str, Any]]:
    """Median milliseconds per provider and pass, with TF/s and GB/s; failures are reported."""
    from triton.testing import do_bench

    tensors, kw = case.make_inputs(dtype)
    element_size = tensors[0].element_size()
    first = "fwd" if case.has_backward else "step"
    passes = [(first, case.forward_flops, case.forward_bytes(element_size))]
    if case.has_backward:
        passes.append(
            (
                "fwd+bwd",
                case.forward_flops + case.backward_flops,
                case.forward_bytes(element_size) + case.backward_bytes(element_size),
            )
        )
    rows: list[dict[str, Any]] = []
    for provider, fn in implementations(case.op, with_compile=with_compile).items():
        for name, flops, nbytes in passes:

            def run(fn: Callable[..., Any] = fn, name: str = name) -> None:
                if name != "fwd+bwd":
                    with torch.no_grad():
                        _call(case.op, fn, tensors, kw)
                    return
                out = _call(case.op, fn, tensors, kw)
                out.backward(torch.ones_like(out))

            try:
                ms = do_bench(run, warmup=10, rep=50, grad_to_none=tensors)
            except Exception as exc:  # a provider failing one shape should not end the run
                rows.append(dict(op=case.op, shape=case.shape, pass_=name, provider=provider,
                                 error=f"{type(exc).__name__}: {exc}"[:60]))  # fmt: skip
                continue
            rows.append(
                dict(op=case.op, shape=case.shape, pass_=name, provider=provider, ms=ms,
                     tflops=flops / ms / 1e9, gbps=nbytes / ms / 1e6)
            )  # fmt: skip
    return rows


def render(rows: Sequence[dict[str, Any]], dtype: torch.dtype) -> None:
    from rich.console import Console
    from rich.table import Table

    eager = {(r["op"], r["pass_"]): r["ms"] for r in rows if r["provider"] == "torch" and "ms" in r}
    table = Table(title=f"kernels on {torch.cuda.get_device_name()} ({dtype})")
    for column in ("op", "shape", "pass", "provider", "ms", "TF/s", "GB/s", "× eager"):
        table.add_column(column, justify="right" if column in ("ms", "TF/s", "GB/s") else "left")
    for r in rows:
        if "error" in r:
            table.add_row(r["op"], r["shape"], r["pass_"], r["provider"], "[red]failed[/red]",
                          "", "", r["error"])  # fmt: skip
            continue
        baseline = eager.get((r["op"], r["pass_"]))
        speedup = f"{baseline / r['ms']:.2f}" if baseline else "—"
        table.add_row(r["op"], r["shape"], r["pass_"], r["provider"], f"{r['ms']:.3f}",
                      f"{r['tflops']:.1f}", f"{r['gbps']:.0f}", speedup)  # fmt: skip
    Console().print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--ops", default="", help="comma-separated ops (default: all)")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--tokens", type=int, default=8192, help="rows through norms and MLP")
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--json", type=Path, help="write the rows here after every op")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "no CUDA device: the Triton kernels can only run under the interpreter "
            "(TRITON_INTERPRET=1) here, which checks correctness and is not a performance "
            "target, so they cannot be timed. Run this on a GPU machine."
        )
        return 0
    try:
        import triton  # noqa: F401
    except ImportError:
        print("triton is not installed: nothing to benchmark")
        return 0
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        parser.error("--hidden must split into --heads heads of even size")
    dtype = getattr(torch, args.dtype)
    selected = {name for name in args.ops.split(",") if name}
    all_cases = cases(args.tokens, args.hidden, args.ffn, args.vocab, args.seq, args.heads)
    unknown = selected - {c.op for c in all_cases}
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}; known: {[c.op for c in all_cases]}")
    rows: list[dict[str, Any]] = []
    for case in all_cases:
        if selected and case.op not in selected:
            continue
        rows.extend(time_case(case, dtype, with_compile=not args.no_compile))
        torch.cuda.empty_cache()
        if args.json is not None:  # after every op: a run cut off still has what it timed
            device = torch.cuda.get_device_name()
            args.json.write_text(json.dumps({"device": device, "dtype": args.dtype, "rows": rows}))
    render(rows, dtype)
    print_tuned_tiles()
    return 0


def print_tuned_tiles() -> None:
    """The tiles the autotuner chose on this GPU for the problems just timed (the kernels
    with candidates: attention and grouped GEMM; the others have one tile per row width)."""
    from rich.console import Console
    from rich.table import Table

    from plait.plugins.kernels_triton.tuning import TileTuner

    table = Table(title="Triton tiles chosen on this GPU (plait.plugins.kernels_triton.tuning)")
    for column in ("kernel", "problem", "tile"):
        table.add_column(column)
    for tuner in TileTuner.registered():
        for (_, problem), chosen in sorted(tuner.chosen().items(), key=str):
            default = " (the default)" if chosen == tuner.default else ""
            table.add_row(tuner.kernel, " | ".join(map(str, problem)), f"{chosen}{default}")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
