"""`grouped_mm`: the torch reference against a plain per-group matmul, and the Triton kernel
against the reference under the Triton interpreter (empty groups, groups that do not fill a
tile, non-power-of-two widths), forward and both gradients."""

from __future__ import annotations

import pytest
import torch

from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins.kernels_torch.grouped_gemm import grouped_mm as reference
from tests.unit.triton_interpreter import interpreted_only

COUNTS = [5, 0, 37, 1, 20]  # an empty group, a group of one, one spanning two row tiles


def _operands(seed: int, k: int = 24, m: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(COUNTS), k, generator=generator).requires_grad_()
    weight = torch.randn(len(COUNTS), m, k, generator=generator).requires_grad_()
    return x, weight


def test_reference_is_a_matmul_per_group() -> None:
    x, weight = _operands(0)
    counts = torch.tensor(COUNTS)
    out = reference(x, weight, counts)
    start = 0
    for group, size in enumerate(COUNTS):
        expected = x[start : start + size] @ weight[group].T
        torch.testing.assert_close(out[start : start + size], expected)
        start += size
    out.sum().backward()
    assert weight.grad is not None and weight.grad[1].abs().sum() == 0  # the empty group


@pytest.mark.triton
@interpreted_only
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_triton_matches_reference() -> None:
    pytest.importorskip("triton")
    from plait.plugins.kernels_triton.grouped_gemm import grouped_mm

    counts = torch.tensor(COUNTS)
    x, weight = _operands(1)
    x_ref, weight_ref = (t.detach().clone().requires_grad_() for t in (x, weight))
    grad = torch.randn(sum(COUNTS), weight.shape[1], generator=torch.Generator().manual_seed(2))
    out = grouped_mm(x, weight, counts)
    out_ref = reference(x_ref, weight_ref, counts)
    tolerance = {"atol": 1e-4, "rtol": 1e-4}
    torch.testing.assert_close(out, out_ref, **tolerance)
    out.backward(grad)
    out_ref.backward(grad)
    torch.testing.assert_close(x.grad, x_ref.grad, **tolerance)
    torch.testing.assert_close(weight.grad, weight_ref.grad, **tolerance)


@pytest.mark.triton
@interpreted_only
def test_facade_gives_triton_when_asked_on_cpu() -> None:
    pytest.importorskip("triton")
    kernels = Kernels(Plugins.create(autoload=False), prefer=["triton"])
    assert kernels.provider_of("grouped_mm", "cpu", torch.float32) == "triton"
    assert (
        Kernels(Plugins.create(autoload=False)).provider_of("grouped_mm", "cpu", torch.float32)
        == "torch"
    )
