"""plait's Triton kernels compiled for the GPU inside `torch.compile(fullgraph=True)` with
inductor: one graph, the kernels as custom ops, results and gradients those of eager."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tests.unit.test_triton_custom_ops import block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_block_compiles_with_inductor_and_matches_eager(dtype: torch.dtype) -> None:
    def run(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        generator = torch.Generator(device="cuda").manual_seed(0)
        x, w, b = (
            torch.randn(s, device="cuda", generator=generator).to(dtype).requires_grad_()
            for s in ((16, 64), (64,), (64,))
        )
        cos = torch.randn(8, 16, device="cuda", generator=generator).to(dtype)
        sin = torch.randn(8, 16, device="cuda", generator=generator).to(dtype)
        targets = torch.randint(0, 64, (16,), device="cuda", generator=generator)
        loss = fn(x, w, b, cos, sin, targets)
        (3 * loss).backward()
        return [loss.detach().float(), x.grad.float(), w.grad.float(), b.grad.float()]

    eager = run(block)
    torch._dynamo.reset()
    compiled = run(torch.compile(block, fullgraph=True))
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
