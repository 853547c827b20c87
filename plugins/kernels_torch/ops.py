"""Reference implementations of every kernel op in plain, autograd-correct PyTorch.

These are the ops `plait.core.kernels.KERNEL_OPS` names, with the signatures documented in
`plait.core.kernels`. They run wherever torch runs (CPU, CUDA, the meta device for shape
inference) and are the ground truth that faster providers (Triton, …) are tested against.

Normalisations and RoPE compute in at least float32 and cast back, as reference Llama/GPT-2 code
does, so bf16/fp16 activations do not lose precision in the reduction; float64 stays float64 so
`torch.autograd.gradcheck` can be used on them.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from plait.core.documents import document_mask

PROVIDER = "torch"

_F = TypeVar("_F", bound=Callable[..., Any])


def _provided(fn: _F) -> _F:
    """Tag an op with its provider, which `Kernels` reports when no provider was forced."""
    fn.plait_provider = PROVIDER  # type: ignore[attr-defined]
    return fn


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@_provided
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x / sqrt(mean(x², last dim) + eps) * weight` (Zhang & Sennrich, 2019)."""
    upcast = x.to(_compute_dtype(x.dtype))
    normed = upcast * torch.rsqrt(upcast.pow(2).mean(dim=-1, keepdim=True) + eps)
    return normed.to(x.dtype) * weight


@_provided
def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Layer normalisation over the last dimension, with an affine weight and optional bias."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


@_provided
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU gated activation: `silu(gate) * up` (Shazeer, 2020)."""
    return F.silu(gate) * up


@_provided
def bias_gelu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`gelu_tanh(x + bias)`: GPT-2's activation with the first MLP bias folded in."""
    return F.gelu(x + bias, approximate="tanh")


@_provided
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding in the "rotate_half" convention.

    `x` is (batch, seq, heads, head_dim) and `cos`/`sin` are (seq, head_dim // 2), or
    (batch, seq, head_dim // 2) when every row has positions of its own (packed documents). The
    first half of `head_dim` is rotated against the second half:
    `[x1·cos − x2·sin, x2·cos + x1·sin]`.
    """
    compute = _compute_dtype(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x.to(compute).split(half, dim=-1)
    # (seq, half) -> (1, seq, 1, half), or (batch, seq, half) -> (batch, seq, 1, half), to
    # broadcast over heads (and batch).
    cos = cos.to(compute).unsqueeze(-2)
    sin = sin.to(compute).unsqueeze(-2)
    if cos.ndim == 3:
        cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return rotated.to(x.dtype)


@_provided
def softmax_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
) -> torch.Tensor:
    """Mean token cross-entropy of (N, V) logits, in float32 at least, skipping `ignore_index`."""
    return F.cross_entropy(
        logits.to(_compute_dtype(logits.dtype)), targets, ignore_index=ignore_index
    )


@_provided
def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    *,
    return_lse: bool = False,
    document_ids: torch.Tensor | None = None,
    key_document_ids: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention with grouped-query support and document masking.

    `q` is (batch, heads, seq, head_dim); `k`/`v` are (batch, kv_heads, seq, head_dim) and each
    group of `heads // kv_heads` query heads shares one key/value head. SDPA's `enable_gqa` lets
    the flash/memory-efficient backends read shared heads without materialising copies.

    `document_ids` (batch, seq_q) names each query's document and `key_document_ids`
    (batch, seq_k) each key's (default: `document_ids`, self-attention over packed rows): a query
    attends only to keys of its own document (`plait.core.documents`). A query that sees no key
    at all (possible when the keys are another block of the sequence, as in ring attention)
    gets output 0 and log-sum-exp −inf.

    `return_lse=True` also returns the natural log-sum-exp of each query row's scaled scores,
    (batch, heads, seq) in float32, differentiable: context parallelism merges attention over
    key/value blocks with it. SDPA does not return it, so that path is written out (scores in
    float32 at least).
    """
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % kv_heads != 0:
        raise ValueError(f"attention: {heads} query heads is not a multiple of {kv_heads} kv heads")
    allowed = None
    if document_ids is not None:
        keys = document_ids if key_document_ids is None else key_document_ids
        allowed = document_mask(document_ids, keys, causal=causal)
    elif key_document_ids is not None:
        raise ValueError("attention: key_document_ids given without document_ids")
    if not return_lse and (allowed is None or key_document_ids is None):
        # Self-attention never leaves a query without a key (it sees itself), so SDPA's masked
        # softmax is safe; another block of keys may leave one with none, written out below.
        return F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=allowed,
            is_causal=causal and allowed is None,
            enable_gqa=heads != kv_heads,
        )
    out, lse = _attention_with_lse(q, k, v, causal, allowed)
    return (out, lse) if return_lse else out


def _attention_with_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    allowed: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    needs_graph = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    fused = not needs_graph and q.device.type == "cpu" and q.shape[-2] == k.shape[-2]
    if fused and allowed is None:
        # Nothing to differentiate (a ring's forward pass): SDPA's fused CPU kernel returns the
        # log-sum-exp too and never materialises the scores.
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)[
            :2
        ]
        return out, lse
    compute = _compute_dtype(q.dtype)
    scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) / math.sqrt(q.shape[-1])
    if allowed is None and causal:
        # Bottom-right aligned, as FlashAttention: the last query sees every key.
        q_len, k_len = scores.shape[-2:]
        allowed = ~torch.ones(q_len, k_len, dtype=torch.bool, device=q.device).triu(
            1 + k_len - q_len
        )
    if allowed is None:
        lse = torch.logsumexp(scores, dim=-1)
        return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(compute)).to(q.dtype), lse
    # A row with no allowed key is computed on zeros and then zeroed, so that neither its
    # output nor its gradient is NaN; its log-sum-exp is −inf (it adds nothing to a merge).
    blind = ~allowed.any(dim=-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(blind, 0.0)
    lse = torch.logsumexp(scores, dim=-1)
    probabilities = torch.exp(scores - lse.unsqueeze(-1)).masked_fill(blind, 0.0)
    out = torch.matmul(probabilities, v.to(compute))
    return out.to(q.dtype), lse.masked_fill(blind.squeeze(-1), float("-inf"))


@_provided
@torch.no_grad()
def adamw_step(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW update (Loshchilov & Hutter, 2019) over lists of tensors, in place.

    `step` is the 1-based number of this update (for bias correction). With bias corrections
    `c1 = 1 − β1^step`, `c2 = 1 − β2^step`:

        p ← p·(1 − lr·wd)                       (decoupled weight decay)
        m ← β1·m + (1 − β1)·g
        v ← β2·v + (1 − β2)·g²
        p ← p − (lr / c1) · m / (sqrt(v) / sqrt(c2) + eps)

    which is exactly `torch.optim.AdamW`. Tensors are grouped by (device, dtype) so each group
    runs as a few fused `torch._foreach_*` launches.
    """
    if not len(params) == len(grads) == len(exp_avgs) == len(exp_avg_sqs):
        raise ValueError(
            "adamw_step: params, grads, exp_avgs and exp_avg_sqs must have the same length, got "
            f"{len(params)}, {len(grads)}, {len(exp_avgs)}, {len(exp_avg_sqs)}"
        )
    if step < 1:
        raise ValueError(f"adamw_step: step counts from 1, got {step}")
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    step_size = lr / bias_correction1

    groups: dict[tuple[torch.device, torch.dtype], list[int]] = defaultdict(list)
    for index, param in enumerate(params):
        groups[(param.device, param.dtype)].append(index)
    for indices in groups.values():
        group_params = [params[i] for i in indices]
        group_m = [exp_avgs[i] for i in indices]
        group_v = [exp_avg_sqs[i] for i in indices]
        # Low-precision gradients are promoted to the optimizer state's dtype.
        group_grads = [grads[i].to(exp_avgs[i].dtype) for i in indices]
        if weight_decay != 0.0:
            torch._foreach_mul_(group_params, 1.0 - lr * weight_decay)
        torch._foreach_lerp_(group_m, group_grads, 1.0 - beta1)
        torch._foreach_mul_(group_v, beta2)
        torch._foreach_addcmul_(group_v, group_grads, group_grads, value=1.0 - beta2)
        denom = torch._foreach_sqrt(group_v)
        torch._foreach_div_(denom, bias_correction2_sqrt)
        torch._foreach_add_(denom, eps)
        if all(p.dtype == m.dtype for p, m in zip(group_params, group_m, strict=True)):
            torch._foreach_addcdiv_(group_params, group_m, denom, value=-step_size)
        else:
            # Parameters held in lower precision than their state: update in the state's dtype.
            updates = torch._foreach_div(group_m, denom)
            for param, update in zip(group_params, updates, strict=True):
                param.add_(update.to(param.dtype), alpha=-step_size)


OPS: dict[str, Callable[..., Any]] = {
    "rms_norm": rms_norm,
    "layer_norm": layer_norm,
    "swiglu": swiglu,
    "bias_gelu": bias_gelu,
    "rope": rope,
    "softmax_cross_entropy": softmax_cross_entropy,
    "attention": attention,
    "adamw_step": adamw_step,
}
