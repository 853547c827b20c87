"""Model FLOPs per token and model FLOPs utilisation (MFU), with the formulas written down.

Training FLOPs per token of a decoder-only transformer (Kaplan et al. 2020; PaLM, appendix B;
the same accounting as torchtitan and Megatron-LM):

    flops_per_token = 6·N + attention

- `6·N`: every weight `W` of a matrix multiply costs 2 FLOPs per token forward (multiply and
  add) and 4 backward (gradients w.r.t. the input and w.r.t. `W`). `N` counts the dense
  parameters: all weights **except the embedding tables** (a table lookup does no arithmetic)
  but **including the output projection** to the vocabulary (a real matrix multiply, also when
  it is tied to the input table). Norm gains and biases are included too; they are a rounding
  error (< 0.1 % at 1B parameters).
- attention: per layer and token, the scores `QKᵀ` and the weighted sum `PV` each cost
  `2·T·d_head` FLOPs per head forward, so with backward (×3):

      full attention:    12 · L · H · d_head · T
      causal attention:   6 · L · H · d_head · T   (default)

  where `L` = layers, `H` = query heads, `T` = sequence length. **Convention:** with
  `causal=True` only the lower triangle of the score matrix is counted (what a causal
  FlashAttention kernel actually computes, so MFU is not inflated by masked-out work). PaLM and
  torchtitan count the full square (`causal=False`); their figures are higher by `6·L·H·d_head·T`.
  Grouped-query attention does not change this term: the work scales with query heads.

MFU itself (achieved model FLOPs per second ÷ the devices' peak FLOPs per second) lives in
`plait.daemon.mfu`, the one module the ranks, the daemon, the CLI and the trainer use;
recomputation from activation checkpointing is not model FLOPs and is not counted.
"""

from __future__ import annotations


def attention_flops_per_token(
    *, n_layers: int, n_heads: int, head_dim: int, seq_len: int, causal: bool = True
) -> float:
    """Score and value matmuls, forward + backward: `12·L·H·d_head·T`, halved when `causal`."""
    full = 12.0 * n_layers * n_heads * head_dim * seq_len
    return full / 2 if causal else full


def transformer_flops_per_token(
    *,
    num_params_dense: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    seq_len: int,
    causal: bool = True,
) -> float:
    """Training FLOPs per token: `6·N + 12·L·H·d_head·T` (attention halved when `causal`).

    `num_params_dense` is `N`: parameters without the embedding tables, with the output
    projection (see the module docstring for the conventions).
    """
    for field, value in (
        ("num_params_dense", num_params_dense),
        ("n_layers", n_layers),
        ("n_heads", n_heads),
        ("head_dim", head_dim),
        ("seq_len", seq_len),
    ):
        if value < 0:
            raise ValueError(f"{field} must be >= 0, got {value}")
    return 6.0 * num_params_dense + attention_flops_per_token(
        n_layers=n_layers, n_heads=n_heads, head_dim=head_dim, seq_len=seq_len, causal=causal
    )


_CPU_ATTENTION_REGISTERED = False


def register_cpu_attention_flops() -> None:
    """Teach torch's `FlopCounterMode` the CPU flash-attention kernels, which it does not count
    (it knows the CUDA ones). Same accounting as torch's CUDA formulas: the full score square."""
    global _CPU_ATTENTION_REGISTERED
    if _CPU_ATTENTION_REGISTERED:
        return
    import torch
    from torch.utils.flop_counter import (
        register_flop_formula,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    aten = torch.ops.aten

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:  # type: ignore[no-untyped-def]
        return sdpa_flop_count(query_shape, key_shape, value_shape)

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _backward(  # type: ignore[no-untyped-def]
        grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs
    ) -> int:
        return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)

    _CPU_ATTENTION_REGISTERED = True
