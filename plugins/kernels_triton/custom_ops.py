"""plait's Triton kernels as torch custom ops (`torch.ops.plait.*`), for code under `torch.compile`.

Dynamo cannot trace through the kernels' launch code (tile caches, the interpreter switch), so a
compiled block that calls them breaks its graph at every call and the compiler fuses nothing
around them. As custom ops with fake (meta) implementations and registered backwards they are
single opaque nodes: the block stays one graph (`fullgraph=True` holds) and the compiler fuses
the code between them — the residual adds, casts and reshapes.

Each op is a forward that returns its outputs and what its backward needs, a backward op, and
`register_autograd` joining them. The functions at the end of this module are what the provider
hands out for these ops (`load_kernel`): they call the custom op while
`torch.compiler.is_compiling()`, and the kernels' autograd.Functions (`norms`, `elementwise`,
`cross_entropy`) otherwise, which skip the dispatcher's per-call cost. Both run the same
launchers.

Covered: rms_norm, layer_norm, swiglu, bias_gelu, rope, softmax_cross_entropy, attention (its
document ids go in as the validated id tensors, its log-sum-exp comes out base 2 beside the
output). Not adamw_step and grouped_mm (in place, data-shaped): under compile they still break
the graph.

Cross-entropy's forward returns the loss with the per-row log-sum-exp and the count of scored
rows, which its backward op reads beside the logits: as eager, nothing logits-sized is kept
between forward and backward but the logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from plait.plugins.kernels_triton import attention as eager_attention
from plait.plugins.kernels_triton import cross_entropy as eager_cross_entropy
from plait.plugins.kernels_triton import elementwise as eager_elementwise
from plait.plugins.kernels_triton import norms as eager_norms
from plait.plugins.kernels_triton.attention import LOG2_E, attention_backward, attention_forward
from plait.plugins.kernels_triton.cross_entropy import (
    DEFAULT_VOCAB_BLOCK,
    cross_entropy_backward,
    cross_entropy_forward,
)
from plait.plugins.kernels_triton.elementwise import (
    bias_gelu_backward,
    bias_gelu_forward,
    rotate,
    swiglu_backward,
    swiglu_forward,
)
from plait.plugins.kernels_triton.norms import (
    layer_norm_backward,
    layer_norm_forward,
    rms_norm_backward,
    rms_norm_forward,
)
from plait.plugins.kernels_triton.varlen_attention import (
    BlockRanges,
    DocumentIds,
    document_ids_of,
)

NAMESPACE = "plait"


def _rows(x: Tensor) -> int:
    return x.numel() // x.shape[-1] if x.shape[-1] else 0


# -- rms_norm ---------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::rms_norm", mutates_args=())
def rms_norm_op(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return rms_norm_forward(x, weight, eps)


@rms_norm_op.register_fake
def _(x: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), x.new_empty(_rows(x), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor]:
    return rms_norm_backward(dy, x, weight, rstd)


@rms_norm_backward_op.register_fake
def _(dy: Tensor, x: Tensor, weight: Tensor, rstd: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x), torch.empty_like(weight)


def _rms_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _rms_norm_grad(ctx: Any, dy: Tensor, _drstd: Tensor) -> tuple[Tensor, Tensor, None]:
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = rms_norm_backward_op(dy.contiguous(), x, weight, rstd)
    return dx, dweight, None


rms_norm_op.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# -- layer_norm -------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::layer_norm", mutates_args=())
def layer_norm_op(
    x: Tensor, weight: Tensor, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    return layer_norm_forward(x, weight, bias, eps)


@layer_norm_op.register_fake
def _(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    stats = x.new_empty(_rows(x), dtype=torch.float32)
    return torch.empty_like(x), stats, torch.empty_like(stats)


@torch.library.custom_op(f"{NAMESPACE}::layer_norm_backward", mutates_args=())
def layer_norm_backward_op(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    dx, dweight, dbias = layer_norm_backward(dy, x, weight, bias, mean, rstd)
    # An op returns tensors only: no bias, an empty bias gradient (dropped by the autograd).
    return dx, dweight, dbias if dbias is not None else weight.new_empty(0)


@layer_norm_backward_op.register_fake
def _(
    dy: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, mean: Tensor, rstd: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    dbias = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return torch.empty_like(x), torch.empty_like(weight), dbias


def _layer_norm_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    x, weight, bias, _ = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight, bias, output[1], output[2])


def _layer_norm_grad(ctx: Any, dy: Tensor, *_stats: Tensor) -> tuple[Tensor | None, ...]:
    x, weight, bias, mean, rstd = ctx.saved_tensors
    dx, dweight, dbias = layer_norm_backward_op(dy.contiguous(), x, weight, bias, mean, rstd)
    return dx, dweight, dbias if ctx.has_bias else None, None


layer_norm_op.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


# -- swiglu and bias_gelu: point-wise, the backward recomputes the activation -----------------


@torch.library.custom_op(f"{NAMESPACE}::swiglu", mutates_args=())
def swiglu_op(gate: Tensor, up: Tensor) -> Tensor:
    return swiglu_forward(gate, up)


@swiglu_op.register_fake
def _(gate: Tensor, up: Tensor) -> Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::swiglu_backward", mutates_args=())
def swiglu_backward_op(dout: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    return swiglu_backward(dout, gate, up)


@swiglu_backward_op.register_fake
def _(dout: Tensor, gate: Tensor, up: Tensor) -> tuple[Tensor, Tensor]:
    contiguous = torch.contiguous_format
    return (
        torch.empty_like(gate, memory_format=contiguous),
        torch.empty_like(up, memory_format=contiguous),
    )


def _save_inputs(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _swiglu_grad(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor]:
    return swiglu_backward_op(dout, *ctx.saved_tensors)


swiglu_op.register_autograd(_swiglu_grad, setup_context=_save_inputs)


@torch.library.custom_op(f"{NAMESPACE}::bias_gelu", mutates_args=())
def bias_gelu_op(x: Tensor, bias: Tensor) -> Tensor:
    return bias_gelu_forward(x, bias)


@bias_gelu_op.register_fake
def _(x: Tensor, bias: Tensor) -> Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{NAMESPACE}::bias_gelu_backward", mutates_args=())
def bias_gelu_backward_op(dout: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return bias_gelu_backward(dout, x, bias)


@bias_gelu_backward_op.register_fake
def _(dout: Tensor, x: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(bias)


def _bias_gelu_grad(ctx: Any, dout: Tensor) -> tuple[Tensor, Tensor]:
    return bias_gelu_backward_op(dout, *ctx.saved_tensors)


bias_gelu_op.register_autograd(_bias_gelu_grad, setup_context=_save_inputs)


# -- rope: the backward is the inverse rotation ------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope_op(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return rotate(x, cos, sin, inverse)


@rope_op.register_fake
def _(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool) -> Tensor:
    return x.new_empty(x.shape)


def _rope_setup(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
    _, cos, sin, inverse = inputs
    ctx.inverse = inverse
    ctx.save_for_backward(cos, sin)


def _rope_grad(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
    cos, sin = ctx.saved_tensors
    return rope_op(dout, cos, sin, not ctx.inverse), None, None, None


rope_op.register_autograd(_rope_grad, setup_context=_rope_setup)


# -- softmax_cross_entropy --------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::softmax_cross_entropy", mutates_args=())
def cross_entropy_op(
    logits: Tensor, targets: Tensor, ignore_index: int, vocab_block: int
) -> tuple[Tensor, Tensor, Tensor]:
    return cross_entropy_forward(logits, targets, ignore_index, vocab_block)


@cross_entropy_op.register_fake
def _(
    logits: Tensor, targets: Tensor, ignore_index: int, vocab_block: int
) -> tuple[Tensor, Tensor, Tensor]:
    scalar = logits.new_empty((), dtype=torch.float32)
    return scalar, logits.new_empty(logits.shape[:1], dtype=torch.float32), torch.empty_like(scalar)


@torch.library.custom_op(f"{NAMESPACE}::softmax_cross_entropy_backward", mutates_args=())
def cross_entropy_backward_op(
    dloss: Tensor,
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    n_valid: Tensor,
    ignore_index: int,
    vocab_block: int,
) -> Tensor:
    return cross_entropy_backward(dloss, logits, targets, lse, n_valid, ignore_index, vocab_block)


@cross_entropy_backward_op.register_fake
def _(
    dloss: Tensor,
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    n_valid: Tensor,
    ignore_index: int,
    vocab_block: int,
) -> Tensor:
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _cross_entropy_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    logits, targets, ctx.ignore_index, ctx.vocab_block = inputs
    ctx.save_for_backward(logits, targets, output[1], output[2])


def _cross_entropy_grad(
    ctx: Any, dloss: Tensor, _dlse: Tensor, _dn_valid: Tensor
) -> tuple[Tensor | None, ...]:
    logits, targets, lse, n_valid = ctx.saved_tensors
    grad = cross_entropy_backward_op(
        dloss, logits, targets, lse, n_valid, ctx.ignore_index, ctx.vocab_block
    )
    return grad, None, None, None


cross_entropy_op.register_autograd(_cross_entropy_grad, setup_context=_cross_entropy_setup)


# -- attention --------------------------------------------------------------------------------


@torch.library.custom_op(f"{NAMESPACE}::attention", mutates_args=())
def attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    block_m: int | None,
    block_n: int | None,
    query_ids: Tensor | None,
    key_ids: Tensor | None,
    ids_in_order: Tensor | None,
) -> tuple[Tensor, Tensor]:
    documents = _documents(query_ids, key_ids, ids_in_order)
    given = eager_attention.given_tile(block_m, block_n)
    return attention_forward(q, k, v, causal, given, BlockRanges(documents))


@attention_op.register_fake
def _(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool,
    block_m: int | None,
    block_n: int | None,
    query_ids: Tensor | None,
    key_ids: Tensor | None,
    ids_in_order: Tensor | None,
) -> tuple[Tensor, Tensor]:
    batch, n_heads, seq_q, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, n_heads, seq_q), dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::attention_backward", mutates_args=())
def attention_backward_op(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    block_m: int | None,
    block_n: int | None,
    query_ids: Tensor | None,
    key_ids: Tensor | None,
    ids_in_order: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    documents = _documents(query_ids, key_ids, ids_in_order)
    given = eager_attention.given_tile(block_m, block_n)
    return attention_backward(dout, dlse, q, k, v, out, lse, causal, given, BlockRanges(documents))


@attention_backward_op.register_fake
def _(
    dout: Tensor,
    dlse: Tensor | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    causal: bool,
    block_m: int | None,
    block_n: int | None,
    query_ids: Tensor | None,
    key_ids: Tensor | None,
    ids_in_order: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _documents(
    query_ids: Tensor | None, key_ids: Tensor | None, ids_in_order: Tensor | None
) -> DocumentIds | None:
    """The validated ids `DocumentIds.of` made before the op (the op takes tensors only)."""
    if query_ids is None or key_ids is None or ids_in_order is None:
        return None
    return DocumentIds(query_ids, key_ids, ids_in_order)


def _attention_setup(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    q, k, v, ctx.causal, ctx.block_m, ctx.block_n, query_ids, key_ids, in_order = inputs
    ctx.save_for_backward(q, k, v, *output, query_ids, key_ids, in_order)


def _attention_grad(ctx: Any, dout: Tensor, dlse: Tensor | None) -> tuple[Tensor | None, ...]:
    q, k, v, out, lse, query_ids, key_ids, in_order = ctx.saved_tensors
    # The op's lse is base 2 (lse · log2 e); the kernels take the natural one's gradient.
    dlse_natural = None if dlse is None else dlse * LOG2_E
    dq, dk, dv = attention_backward_op(
        dout, dlse_natural, q, k, v, out, lse, ctx.causal, ctx.block_m, ctx.block_n,
        query_ids, key_ids, in_order,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None


attention_op.register_autograd(_attention_grad, setup_context=_attention_setup)


# -- what the provider hands out: the custom op under the compiler, the Function otherwise -----


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """`norms.rms_norm`, one graph node under `torch.compile`."""
    if torch.compiler.is_compiling():
        return rms_norm_op(x, weight, eps)[0]
    return eager_norms.rms_norm(x, weight, eps)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float) -> Tensor:
    """`norms.layer_norm`, one graph node under `torch.compile`."""
    if torch.compiler.is_compiling():
        return layer_norm_op(x, weight, bias, eps)[0]
    return eager_norms.layer_norm(x, weight, bias, eps)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """`elementwise.swiglu`, one graph node under `torch.compile`."""
    if torch.compiler.is_compiling():
        return swiglu_op(gate, up)
    return eager_elementwise.swiglu(gate, up)


def bias_gelu(x: Tensor, bias: Tensor) -> Tensor:
    """`elementwise.bias_gelu`, one graph node under `torch.compile`."""
    if torch.compiler.is_compiling():
        return bias_gelu_op(x, bias)
    return eager_elementwise.bias_gelu(x, bias)


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`elementwise.rope`, one graph node under `torch.compile`."""
    if torch.compiler.is_compiling():
        return rope_op(x, cos, sin, False)
    return eager_elementwise.rope(x, cos, sin)


def softmax_cross_entropy(
    logits: Tensor,
    targets: Tensor,
    ignore_index: int = -100,
    *,
    vocab_block: int = DEFAULT_VOCAB_BLOCK,
) -> Tensor:
    """`cross_entropy.softmax_cross_entropy`, one graph node under `torch.compile`."""
    if torch.compiler.is_compiling():
        if vocab_block <= 0 or vocab_block & (vocab_block - 1):
            raise ValueError(f"vocab_block must be a power of two, got {vocab_block}")
        return cross_entropy_op(logits, targets, ignore_index, vocab_block)[0]
    return eager_cross_entropy.softmax_cross_entropy(
        logits, targets, ignore_index, vocab_block=vocab_block
    )


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    causal: bool = True,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    return_lse: bool = False,
    document_ids: Tensor | None = None,
    key_document_ids: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """`attention.attention`, one graph node under `torch.compile` (two with its lse)."""
    if not torch.compiler.is_compiling():
        return eager_attention.attention(
            q, k, v, causal, block_m=block_m, block_n=block_n, return_lse=return_lse,
            document_ids=document_ids, key_document_ids=key_document_ids,
        )  # fmt: skip
    eager_attention.check_blocks(block_m, block_n)
    documents = document_ids_of(q, k, document_ids, key_document_ids)
    ids = (None, None, None) if documents is None else (
        documents.queries, documents.keys, documents.in_order
    )  # fmt: skip
    out, lse = attention_op(q, k, v, causal, block_m, block_n, *ids)
    # The kernel keeps log2 of the sum over exp2 of log2(e)-scaled scores.
    return (out, lse / LOG2_E) if return_lse else out
