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


@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_every_norm_tile_compiles_and_computes(op: str, tmp_path: Path) -> None:
    """Each warps × programs-per-SM tile of the norms' backward (and each forward warps) at a
    Llama-like width, in bf16, against the fp32 reference."""
    from plait.plugins.kernels_triton import norms
    from plait.plugins.kernels_triton.tuning import TileStore, tuning

    forward = getattr(norms, f"{op.upper()}_FORWARD_TILES")
    backward = getattr(norms, f"{op.upper()}_BACKWARD_TILES")
    forward_tiles, _ = norms._row_candidates(4096, False)
    backward_tiles, _ = norms._row_candidates(4096, True)
    generator = torch.Generator(device="cuda").manual_seed(0)
    leaves = [torch.randn(3000, 4096, device="cuda", generator=generator)]
    leaves += [torch.rand(4096, device="cuda", generator=generator) + 0.5]
    leaves += [torch.randn(4096, device="cuda", generator=generator)] if op == "layer_norm" else []
    for index, wanted_backward in enumerate(backward_tiles):
        wanted = {forward.kernel: forward_tiles[index % len(forward_tiles)],
                  backward.kernel: wanted_backward}  # fmt: skip

        def bench(
            kernel: str, candidate: object, run: Callable[[], object], wanted: dict = wanted
        ) -> float:
            if candidate != wanted[kernel]:
                return 1.0
            run()
            return 0.0

        ours = [t.bfloat16().requires_grad_() for t in leaves]
        theirs = [t.bfloat16().float().requires_grad_() for t in leaves]
        with tuning(bench=bench, store=TileStore(tmp_path / f"{index}.json")):
            out = getattr(norms, op)(*ours, 1e-5)
            upstream = torch.randn(out.shape, device="cuda", generator=generator)
            out.float().backward(upstream)
            chosen = set(forward.chosen().values()) | set(backward.chosen().values())
        assert chosen == set(wanted.values())
        expected = getattr(reference, op)(*theirs, 1e-5)
        expected.backward(upstream)
        torch.testing.assert_close(out.float(), expected, **BF16)
        # dx per row; dweight and dbias sum 3000 rows: bf16 rounding of the inputs dominates.
        for position, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
            tolerance = BF16 if position == 0 else {"atol": 2.0, "rtol": 4e-2}
            torch.testing.assert_close(mine.grad.float(), ref.grad, **tolerance)


def test_the_norms_are_tuned_by_timing(tmp_path: Path) -> None:
    """Real CUDA-event timing chooses the norms' tiles at the 1B Llama's width; the choice and
    its time against the default's are printed for the record."""
    from plait.plugins.kernels_triton import norms
    from plait.plugins.kernels_triton.tuning import TileStore, cuda_bench, tuning

    times: dict[tuple[str, str], float] = {}

    def recording(kernel: str, candidate: object, run: Callable[[], object]) -> float:
        times[kernel, str(candidate)] = cuda_bench(kernel, candidate, run)
        return times[kernel, str(candidate)]

    x = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    tuners = {norms.RMS_NORM_FORWARD_TILES: False, norms.RMS_NORM_BACKWARD_TILES: True}
    with tuning(bench=recording, store=TileStore(tmp_path / "tiles.json")):
        norms.rms_norm(x, weight, 1e-6).sum().backward()
        chosen_by = {tuner: set(tuner.chosen().values()) for tuner in tuners}
    for tuner, backward in tuners.items():
        tried, default = norms._row_candidates(2048, backward)
        assert {c for k, c in times if k == tuner.kernel} == {str(t) for t in tried}
        (chosen,) = chosen_by[tuner]
        fastest = min((ms, c) for (k, c), ms in times.items() if k == tuner.kernel)[1]
        assert str(chosen) == fastest
        print(f"{tuner.kernel} 8192×2048 bf16 on {torch.cuda.get_device_name()}: {chosen} "
              f"{times[tuner.kernel, str(chosen)]:.4f} ms, default {default} "
              f"{times[tuner.kernel, str(default)]:.4f} ms")  # fmt: skip
