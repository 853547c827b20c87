"""Every Triton kernel compiled for the GPU, forward and backward, in fp32, fp16 and bf16, on odd
shapes, against the torch reference computed in fp32 from the same (rounded) inputs."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

from plait.plugins.kernels_torch import grouped_gemm as reference_grouped
from plait.plugins.kernels_torch import ops as reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) against the fp32 reference: fp32 kernels use IEEE dots (TF32 off), half types
# round every stored tile.
TOLERANCES = {
    torch.float32: (1e-4, 1e-3),
    torch.float16: (1e-2, 1e-2),
    torch.bfloat16: (4e-2, 4e-2),
}


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    import plait.plugins.kernels_triton as kernels_triton

    return kernels_triton.load_kernel(name)


def _compare(
    op: str,
    shapes: Sequence[tuple[int, ...]],
    dtype: torch.dtype,
    call: Callable[[Callable[..., torch.Tensor], list[torch.Tensor]], torch.Tensor],
    *,
    scale: float = 1.0,
    seed: int = 0,
) -> None:
    generator = torch.Generator(device="cuda").manual_seed(seed)
    inputs = [torch.randn(s, device="cuda", generator=generator) * scale for s in shapes]
    ours = [t.to(dtype).requires_grad_() for t in inputs]
    theirs = [t.to(dtype).float().requires_grad_() for t in inputs]
    out = call(_kernel(op), ours)
    expected = call(getattr(reference, op), theirs)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    upstream = torch.randn(out.shape, device="cuda", generator=generator)
    out.float().backward(upstream)
    expected.backward(upstream)
    for index, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.grad is not None and mine.grad.dtype == dtype, f"input {index}"
        torch.testing.assert_close(
            mine.grad.float(), ref.grad, atol=atol * 4, rtol=rtol * 4, msg=f"gradient {index}"
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_norms(dtype: torch.dtype) -> None:
    _compare("rms_norm", [(3, 37, 1000), (1000,)], dtype, lambda f, t: f(t[0], t[1], 1e-5))
    _compare(
        "layer_norm",
        [(5, 19, 771), (771,), (771,)],
        dtype,
        lambda f, t: f(t[0], t[1], t[2], 1e-5),
        seed=1,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_elementwise(dtype: torch.dtype) -> None:
    _compare("swiglu", [(3, 11, 1733), (3, 11, 1733)], dtype, lambda f, t: f(*t), seed=2)
    _compare("bias_gelu", [(4, 7, 999), (999,)], dtype, lambda f, t: f(*t), seed=3)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_on_strided_heads(dtype: torch.dtype) -> None:
    angles = torch.rand(13, 40, device="cuda") * 6
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    _compare(
        "rope",
        [(2, 13, 5, 80)],
        dtype,
        lambda f, t: f(t[0][..., :3, :], cos.to(t[0].dtype), sin.to(t[0].dtype)),
        seed=4,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_softmax_cross_entropy(dtype: torch.dtype) -> None:
    targets = torch.randint(0, 50_257, (37,), device="cuda")
    targets[[1, 4]] = -100
    _compare(
        "softmax_cross_entropy",
        [(37, 50_257)],
        dtype,
        lambda f, t: f(t[0], targets, -100),
        scale=3.0,
        seed=5,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "seq", "head_dim", "causal"),
    [(8, 2, 1037, 64, True), (4, 4, 333, 128, False), (6, 1, 77, 40, True)],
)
def test_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, seq: int, head_dim: int, causal: bool
) -> None:
    shapes = [(2, heads, seq, head_dim), *[(2, kv_heads, seq, head_dim)] * 2]
    _compare("attention", shapes, dtype, lambda f, t: f(*t, causal), seed=6)


def test_attention_under_torch_compile_with_symbolic_shapes() -> None:
    """Compiled with dynamic shapes, the scale once reached the kernel as a float64 scalar (it
    made Triton refuse the forward kernel: a float64 running max in its loop). Attention is a
    custom op now, one node with symbolic shapes: the graph holds whole (`fullgraph=True`)."""
    attention = _kernel("attention")
    generator = torch.Generator(device="cuda").manual_seed(11)
    for seq in (96, 160):  # a second length keeps the compiled graph's shapes symbolic
        q, k, v = (
            torch.randn(2, heads, seq, 64, device="cuda", generator=generator, dtype=torch.bfloat16)
            for heads in (4, 2, 2)
        )

        def loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            return attention(q, k, v, True).float().square().mean()

        compiled = torch.compile(loss, dynamic=True, fullgraph=True)
        inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        eager_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*inputs).backward()
        loss(*eager_inputs).backward()
        for got, want in zip(inputs, eager_inputs, strict=True):
            torch.testing.assert_close(got.grad, want.grad, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_grouped_mm(dtype: torch.dtype) -> None:
    counts = torch.tensor([0, 37, 129, 5], device="cuda")
    rows = int(counts.sum())

    def call(f: Callable[..., torch.Tensor], t: list[torch.Tensor]) -> torch.Tensor:
        return f(t[0], t[1], counts)

    generator = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(rows, 96, device="cuda", generator=generator)
    w = torch.randn(4, 200, 96, device="cuda", generator=generator) / 10
    ours = [x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()]
    theirs = [x.to(dtype).float().requires_grad_(), w.to(dtype).float().requires_grad_()]
    out = call(_kernel("grouped_mm"), ours)
    expected = call(reference_grouped.grouped_mm, theirs)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol * 10, rtol=rtol)
    out.float().sum().backward()
    expected.sum().backward()
    for mine, ref in zip(ours, theirs, strict=True):
        torch.testing.assert_close(mine.grad.float(), ref.grad, atol=atol * 40, rtol=rtol * 4)


def test_adamw_step_matches_reference() -> None:
    generator = torch.Generator(device="cuda").manual_seed(8)
    shapes = [(1037, 5), (100_001,), (3, 4, 7)]
    params = [torch.randn(s, device="cuda", generator=generator) for s in shapes]
    ref_params = [p.clone() for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    ref_state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grads = [torch.randn(p.shape, device="cuda", generator=generator) for p in params]
        _kernel("adamw_step")(params, grads, *state, step=step, **hyper)
        reference.adamw_step(ref_params, grads, *ref_state, step=step, **hyper)
    for ours, ref in zip(
        [*params, *state[0], *state[1]], [*ref_params, *ref_state[0], *ref_state[1]], strict=True
    ):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5)
