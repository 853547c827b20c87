"""The torch reference kernels: registration, resolution, values against naive formulas,
float64 gradchecks, and AdamW against `torch.optim.AdamW`."""

from __future__ import annotations

import math

import pytest
import torch

from plait.core.kernels import KERNEL_OPS, Kernels
from plait.plugins.kernels_torch import ops


@pytest.fixture
def kernels(plugins) -> Kernels:
    return Kernels(plugins)


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape: int, dtype: torch.dtype = torch.float32, seed: int = 0, grad: bool = False):
    tensor = torch.randn(*shape, generator=_generator(seed), dtype=dtype)
    return tensor.requires_grad_(grad)


# --- registration and resolution ---------------------------------------------------------------


def test_registers_every_core_op_for_cpu_and_cuda(plugins) -> None:
    records = [r for plugin, r in plugins.kernel_records() if plugin == "kernels_torch"]
    reference = [r for r in records if r.provider == "torch"]
    assert sorted(r.op for r in reference) == sorted(KERNEL_OPS)
    assert {r.provider for r in records} == {"torch", "compiled"}  # compiled: its own tests
    assert all(r.device_types == ("cpu", "cuda") for r in records)


@pytest.mark.parametrize("op", KERNEL_OPS)
def test_facade_resolves_each_op_to_the_reference(kernels: Kernels, op: str) -> None:
    impl = kernels.get(op, "cpu", torch.float32)
    assert impl is ops.OPS[op]
    assert impl.plait_provider == "torch"
    assert kernels.provider_of(op, "cpu", torch.float32) == "torch"


def test_answers_only_for_its_own_provider_name(plugins) -> None:
    assert plugins.kernel(name="rms_norm", device="cpu", dtype="float32", provider="torch")
    assert (
        plugins.kernel(name="rms_norm", device="cpu", dtype="float32", provider="no-such-provider")
        is None
    )
    assert plugins.kernel(name="no_such_op", device="cpu", dtype="float32", provider=None) is None


# --- values against naive formulas -------------------------------------------------------------


def test_rms_norm_matches_formula_and_keeps_dtype() -> None:
    x, weight = _randn(3, 5, 16), _randn(16, seed=1)
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * weight
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), expected)
    low = ops.rms_norm(x.bfloat16(), weight.bfloat16(), 1e-6)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), expected, atol=3e-2, rtol=3e-2)


def test_layer_norm_matches_formula() -> None:
    x, weight, bias = _randn(4, 10), _randn(10, seed=1), _randn(10, seed=2)
    mean = x.mean(-1, keepdim=True)
    var = x.var(-1, unbiased=False, keepdim=True)
    expected = (x - mean) / torch.sqrt(var + 1e-5) * weight + bias
    torch.testing.assert_close(ops.layer_norm(x, weight, bias, 1e-5), expected)


def test_swiglu_and_bias_gelu_match_formulas() -> None:
    gate, up, bias = _randn(6, 8), _randn(6, 8, seed=1), _randn(8, seed=2)
    torch.testing.assert_close(ops.swiglu(gate, up), gate * torch.sigmoid(gate) * up)
    z = gate + bias
    gelu_tanh = 0.5 * z * (1 + torch.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z**3)))
    torch.testing.assert_close(ops.bias_gelu(gate, bias), gelu_tanh)


def _rope_tables(seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float64), inv_freq)
    return angles.cos(), angles.sin()


def test_rope_rotates_half_pairs_as_complex_numbers() -> None:
    batch, seq, heads, head_dim = 2, 7, 3, 8
    x = _randn(batch, seq, heads, head_dim, dtype=torch.float64)
    cos, sin = _rope_tables(seq, head_dim)
    half = head_dim // 2
    # Pair i is (x[i], x[i + half]); RoPE multiplies it by exp(i·angle).
    pairs = torch.complex(x[..., :half], x[..., half:])
    rotated = pairs * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[None, :, None, :]
    expected = torch.cat((rotated.real, rotated.imag), dim=-1)
    torch.testing.assert_close(ops.rope(x, cos, sin), expected)


def test_rope_scores_depend_only_on_relative_position() -> None:
    head_dim = 8
    cos, sin = _rope_tables(12, head_dim)
    q = _randn(1, 1, 1, head_dim, dtype=torch.float64).expand(1, 12, 1, head_dim)
    k = _randn(1, 1, 1, head_dim, dtype=torch.float64, seed=1).expand(1, 12, 1, head_dim)
    rq, rk = ops.rope(q, cos, sin)[0, :, 0], ops.rope(k, cos, sin)[0, :, 0]
    scores = rq @ rk.T  # scores[m, n] for query at m, key at n
    torch.testing.assert_close(scores[5, 2], scores[9, 6])
    torch.testing.assert_close(scores[3, 3], scores[10, 10])
    assert not torch.allclose(scores[5, 2], scores[5, 3])


def test_softmax_cross_entropy_matches_formula_and_ignores_index() -> None:
    logits = _randn(6, 11)
    targets = torch.tensor([0, 3, -100, 10, 5, -100])
    keep = targets != -100
    log_probs = logits.log_softmax(-1)
    expected = -log_probs[keep].gather(1, targets[keep, None]).mean()
    torch.testing.assert_close(ops.softmax_cross_entropy(logits, targets), expected)
    loss_bf16 = ops.softmax_cross_entropy(logits.bfloat16(), targets)
    assert loss_bf16.dtype == torch.float32


def _naive_attention(q, k, v, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[2]
        mask = torch.ones(seq, seq, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_matches_naive_softmax_with_grouped_heads(kv_heads: int, causal: bool) -> None:
    q = _randn(2, 4, 9, 8)
    k, v = _randn(2, kv_heads, 9, 8, seed=1), _randn(2, kv_heads, 9, 8, seed=2)
    torch.testing.assert_close(
        ops.attention(q, k, v, causal=causal), _naive_attention(q, k, v, causal)
    )


def test_attention_rejects_heads_not_multiple_of_kv_heads() -> None:
    with pytest.raises(ValueError, match="not a multiple"):
        ops.attention(_randn(1, 3, 4, 8), _randn(1, 2, 4, 8), _randn(1, 2, 4, 8))


# --- gradients in float64 ----------------------------------------------------------------------


def _f64(*shape: int, seed: int) -> torch.Tensor:
    return _randn(*shape, dtype=torch.float64, seed=seed, grad=True)


GRADCHECKS = {
    "rms_norm": lambda: (
        lambda x, w: ops.rms_norm(x, w, 1e-6),
        (_f64(2, 3, 5, seed=0), _f64(5, seed=1)),
    ),
    "layer_norm": lambda: (
        lambda x, w, b: ops.layer_norm(x, w, b, 1e-5),
        (_f64(3, 7, seed=0), _f64(7, seed=1), _f64(7, seed=2)),
    ),
    "rope": lambda: (
        lambda x: ops.rope(x, *_rope_tables(5, 6)),
        (_f64(2, 5, 3, 6, seed=0),),
    ),
    "swiglu": lambda: (ops.swiglu, (_f64(3, 5, seed=0), _f64(3, 5, seed=1))),
    "bias_gelu": lambda: (ops.bias_gelu, (_f64(3, 5, seed=0), _f64(5, seed=1))),
    "attention": lambda: (
        lambda q, k, v: ops.attention(q, k, v, causal=True),
        (_f64(1, 6, 5, 3, seed=0), _f64(1, 2, 5, 3, seed=1), _f64(1, 2, 5, 3, seed=2)),
    ),
    "softmax_cross_entropy": lambda: (
        lambda logits: ops.softmax_cross_entropy(logits, torch.tensor([1, -100, 4, 0, 2])),
        (_f64(5, 7, seed=0),),
    ),
}  # fmt: skip


@pytest.mark.parametrize("op", sorted(GRADCHECKS))
def test_gradcheck_float64(op: str) -> None:
    fn, inputs = GRADCHECKS[op]()
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-5)


# --- AdamW -------------------------------------------------------------------------------------


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_adamw_step_matches_torch_optim_adamw(weight_decay: float) -> None:
    shapes_and_dtypes = [((5, 3), torch.float32), ((7,), torch.float32), ((2, 2, 3), torch.float64)]
    reference = [
        torch.randn(shape, generator=_generator(i), dtype=dtype).requires_grad_()
        for i, (shape, dtype) in enumerate(shapes_and_dtypes)
    ]
    ours = [p.detach().clone() for p in reference]
    exp_avgs = [torch.zeros_like(p) for p in ours]
    exp_avg_sqs = [torch.zeros_like(p) for p in ours]
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    optimizer = torch.optim.AdamW(reference, foreach=False, **hyper)
    for step in range(1, 7):
        grads = [
            torch.randn(p.shape, generator=_generator(100 * step + i), dtype=p.dtype)
            for i, p in enumerate(ours)
        ]
        for param, grad in zip(reference, grads, strict=True):
            param.grad = grad.clone()
        optimizer.step()
        ops.adamw_step(
            ours, grads, exp_avgs, exp_avg_sqs, step=step, lr=1e-2, beta1=0.9, beta2=0.95,
            eps=1e-8, weight_decay=weight_decay,
        )  # fmt: skip
    for mine, theirs in zip(ours, reference, strict=True):
        torch.testing.assert_close(mine, theirs.detach(), rtol=1e-6, atol=1e-7)
    for mine, theirs in zip(exp_avg_sqs, reference, strict=True):
        torch.testing.assert_close(mine, optimizer.state[theirs]["exp_avg_sq"])


def test_adamw_step_validates_its_arguments() -> None:
    param = [torch.zeros(2)]
    kwargs = dict(lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0)
    with pytest.raises(ValueError, match="same length"):
        ops.adamw_step(param, [], param, param, step=1, **kwargs)
    with pytest.raises(ValueError, match="counts from 1"):
        ops.adamw_step(param, param, [torch.zeros(2)], [torch.zeros(2)], step=0, **kwargs)


def test_ops_run_on_the_meta_device() -> None:
    x = torch.empty(2, 4, 3, 8, device="meta")
    cos = torch.empty(4, 4, device="meta")
    assert ops.rope(x, cos, cos).shape == x.shape
    q = x.transpose(1, 2)
    assert ops.attention(q, q, q).shape == q.shape
