"""The Triton autotuner on a real GPU: every candidate tile compiles for this chip and computes
attention and grouped GEMM in bf16, and a real timing (CUDA events) chooses one, keeps it under
the GPU's name and is read back without timing again."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plait.plugins.kernels_torch import ops as reference
from plait.plugins.kernels_torch.grouped_gemm import grouped_mm as grouped_reference

# Against the fp32 reference from the same bf16 inputs, as test_triton_compiled.py: outputs,
# then gradients (sums over a sequence or a group's rows: looser).
BF16 = {"atol": 4e-2, "rtol": 4e-2}
GRADIENT = {"attention": {"atol": 0.16, "rtol": 0.16}, "grouped_mm": {"atol": 1.6, "rtol": 0.16}}


def _forcing(index: int) -> Callable[[str, object, Callable[[], object]], float]:
    """A bench that makes each tuner choose its candidate `index` (cycled)."""
    from plait.plugins.kernels_triton.tuning import TileTuner

    def bench(kernel: str, candidate: object, run: Callable[[], object]) -> float:
        tuner = TileTuner.named(kernel)
        wanted = tuner.candidates[index % len(tuner.candidates)]
        if candidate != wanted:
            return 1.0
        run()
        return 0.0

    return bench


@pytest.mark.parametrize("index", range(6))
def test_every_tile_compiles_and_computes(index: int, tmp_path: Path) -> None:
    from plait.plugins.kernels_triton.attention import attention
    from plait.plugins.kernels_triton.grouped_gemm import grouped_mm
    from plait.plugins.kernels_triton.tuning import TileStore, tuning

    generator = torch.Generator(device="cuda").manual_seed(index)
    shapes = [(2, 8, 1037, 128), (2, 2, 1037, 128), (2, 2, 1037, 128)]
    inputs = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    counts = torch.tensor([0, 37, 300, 5], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", generator=generator)
    w = torch.randn(4, 384, 256, device="cuda", generator=generator) / 16
    with tuning(bench=_forcing(index), store=TileStore(tmp_path / "tiles.json")):
        for op, ours_fn, ref_fn, leaves in (
            ("attention", lambda t: attention(*t, causal=True),
             lambda t: reference.attention(*t, True), inputs),
            ("grouped_mm", lambda t: grouped_mm(*t, counts),
             lambda t: grouped_reference(*t, counts), [x, w]),
        ):  # fmt: skip
            ours = [t.bfloat16().requires_grad_() for t in leaves]
            theirs = [t.bfloat16().float().requires_grad_() for t in leaves]
            out, expected = ours_fn(ours), ref_fn(theirs)
            torch.testing.assert_close(out.float(), expected, **BF16)
            upstream = torch.randn(out.shape, device="cuda", generator=generator)
            out.float().backward(upstream)
            expected.backward(upstream)
            for mine, ref in zip(ours, theirs, strict=True):
                torch.testing.assert_close(mine.grad.float(), ref.grad, **GRADIENT[op])


def test_a_real_timing_chooses_keeps_and_reads_back(tmp_path: Path) -> None:
    from plait.plugins.kernels_triton.attention import FORWARD_TILES, attention
    from plait.plugins.kernels_triton.tuning import TileStore, cuda_bench, tuning

    timed: list[str] = []

    def counting(kernel: str, candidate: object, run: Callable[[], object]) -> float:
        timed.append(kernel)
        return cuda_bench(kernel, candidate, run)

    path = tmp_path / "tiles.json"
    q = torch.randn(4, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k, v = torch.randn_like(q[:, :4]), torch.randn_like(q[:, :4])
    with tuning(bench=counting, store=TileStore(path)):
        attention(q, k, v, causal=True)
    assert timed.count("attention.forward") == len(FORWARD_TILES.candidates)
    saved = json.loads(path.read_text())
    assert torch.cuda.get_device_name() in saved
    chosen = saved[torch.cuda.get_device_name()]["attention.forward"]
    print(f"attention.forward on {torch.cuda.get_device_name()}: {chosen}")

    timed.clear()
    with tuning(bench=counting, store=TileStore(path)):  # a new process: read back
        attention(q, k, v, causal=True)
    assert timed == []
