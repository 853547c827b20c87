"""The FLOPs-per-token formula and MFU, checked by hand and against `FlopCounterMode`."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from plait.core.flops import attention_flops_per_token, transformer_flops_per_token
from plait.core.kernels import Kernels
from plait.daemon.mfu import CALIBRATION_ERROR, format_mfu, mfu
from plait.plugins.kernels_torch import ops
from plait.plugins.models import resolve_model_config


def test_formula_by_hand() -> None:
    # 6·N + 12·L·H·d·T for full attention; half the attention term when causal.
    full = transformer_flops_per_token(
        num_params_dense=1000, n_layers=2, n_heads=3, head_dim=4, seq_len=5, causal=False
    )
    assert full == 6 * 1000 + 12 * 2 * 3 * 4 * 5
    causal = transformer_flops_per_token(
        num_params_dense=1000, n_layers=2, n_heads=3, head_dim=4, seq_len=5
    )
    assert causal == 6 * 1000 + 6 * 2 * 3 * 4 * 5
    assert attention_flops_per_token(n_layers=2, n_heads=3, head_dim=4, seq_len=5) == 720


def test_llama_7b_at_4k_context() -> None:
    config = resolve_model_config("llama", "7b")
    dense = config.num_params(exclude_embeddings=True)
    assert dense == 6_738_415_616 - 32000 * 4096  # the output projection stays in N
    per_token = transformer_flops_per_token(
        num_params_dense=dense, n_layers=32, n_heads=32, head_dim=128, seq_len=4096
    )
    assert per_token == pytest.approx(6 * dense + 6 * 32 * 32 * 128 * 4096)
    assert per_token / 1e9 == pytest.approx(42.87, abs=0.01)


def test_negative_sizes_are_rejected() -> None:
    with pytest.raises(ValueError, match="seq_len"):
        transformer_flops_per_token(
            num_params_dense=1, n_layers=1, n_heads=1, head_dim=1, seq_len=-1
        )


def test_mfu() -> None:
    assert mfu(156e12, 312e12) == pytest.approx(0.5)
    assert mfu(0.0, 1.0) == 0.0
    assert mfu(1.0, 0.0) == 0.0  # peak unknown
    assert mfu(1.0, float("nan")) == 0.0
    assert mfu(-1.0, 1.0) == 0.0
    assert mfu(312e12, 312e12) == pytest.approx(1.0)
    assert mfu(313e12, 312e12) == CALIBRATION_ERROR  # above the peak: the peak is wrong
    assert format_mfu(0.421) == "42.1%"
    assert format_mfu(mfu(2.0, 1.0)) == "calibration error"


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_records_flops_per_token_uses_the_model_shape(plugins, family: str) -> None:
    config = resolve_model_config(family, "tiny")
    record = plugins.model(family)
    expected = transformer_flops_per_token(
        num_params_dense=config.num_params(exclude_embeddings=True),
        n_layers=config.n_layers,
        n_heads=config.n_heads,
        head_dim=config.head_dim,
        seq_len=128,
    )
    assert record.flops_per_token(config, 128) == expected


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_formula_agrees_with_counted_matmul_flops(plugins, family: str) -> None:
    """Count forward + backward matmul FLOPs of one batch with `FlopCounterMode`.

    SDPA's fused CPU kernel is not counted by `FlopCounterMode`, so attention runs on the math
    backend, whose batched matmuls compute (and are counted for) the full T×T score matrix even
    when causal. The count therefore equals the formula with `causal=False` when N is the number
    of matmul weights; the default causal figure is exactly `6·L·H·d_head·T` lower. The model's
    N also holds norm gains and biases, which are not matmul weights: the formula is higher by
    6 FLOPs per such parameter — 0.3 % (llama) and 1.5 % (gpt2, biased) on these tiny models,
    ~0.01 % at 1B parameters.
    """
    config = resolve_model_config(family, "tiny")
    model = plugins.model(family).build(config, Kernels(plugins))
    batch, seq = 2, 32
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        targets = tokens[:, 1:].reshape(-1)
        ops.softmax_cross_entropy(logits.reshape(-1, config.vocab_size), targets).backward()
    counted_per_token = counter.get_total_flops() / (batch * seq)
    shape = dict(
        n_layers=config.n_layers, n_heads=config.n_heads, head_dim=config.head_dim, seq_len=seq
    )
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    exact = transformer_flops_per_token(num_params_dense=matmul_weights, causal=False, **shape)
    assert exact == counted_per_token
    half_attention = 6 * config.n_layers * config.n_heads * config.head_dim * seq
    causal = transformer_flops_per_token(num_params_dense=matmul_weights, **shape)
    assert causal == counted_per_token - half_attention

    dense = model.num_params(exclude_embeddings=True)
    documented = transformer_flops_per_token(num_params_dense=dense, causal=False, **shape)
    assert documented - counted_per_token == 6 * (dense - matmul_weights)
    assert documented == pytest.approx(counted_per_token, rel=0.02)
