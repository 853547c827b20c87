"""The MoE model family: presets on meta, FLOPs per token against `FlopCounterMode`, capacity
drops, the balancing loss reaching the gradients, and both balancing methods flattening the
per-expert load of a skewed input."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from plait.core.flops import attention_flops_per_token
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins.kernels_torch import ops
from plait.plugins.models import resolve_model_config
from plait.plugins.models.moe import MoE, MoELayer, moe_flops_per_token


@pytest.fixture(scope="module")
def plugins() -> Plugins:
    return Plugins.create(autoload=False)


def _build(plugins: Plugins, size: str = "tiny", **overrides: object) -> MoE:
    config = resolve_model_config("moe", size, overrides)
    model = plugins.model("moe").build(config, Kernels(plugins))
    assert isinstance(model, MoE)
    return model


@pytest.mark.parametrize(
    ("size", "total", "active"),
    [("mixtral-8x7b", 46_702_792_704, 12_879_925_248), ("deepseek-v2-lite", None, None)],
)
def test_real_presets_build_on_meta(
    plugins: Plugins, size: str, total: int | None, active: int | None
) -> None:
    config = resolve_model_config("moe", size)
    with torch.device("meta"):
        model = plugins.model("moe").build(config, Kernels(plugins))
    assert sum(p.numel() for p in model.parameters()) == config.num_params()
    if total is not None:  # Mixtral-8x7B: 46.7B parameters, 12.9B active (Mistral AI's figures)
        assert config.num_params() == total
        assert config.num_active_params() == active
    layers = [model.layers[str(i)].feed_forward for i in range(config.n_layers)]
    dense = [i for i, layer in enumerate(layers) if not isinstance(layer, MoELayer)]
    assert dense == list(range(config.first_dense_layers))


@pytest.mark.parametrize("size", ["tiny", "tiny-shared"])
def test_flops_per_token_counts_active_parameters(plugins: Plugins, size: str) -> None:
    """Dropless, every token runs exactly `top_k` experts: the counted matmul FLOPs equal
    `6·(matmul weights a token uses) + 12·L·H·d·T` (the math SDPA backend counts the full
    square), which is `moe_flops_per_token` plus the masked half of attention, less the 6 FLOPs
    per norm gain the formula includes."""
    model = _build(plugins, size)
    config = model.config
    batch, seq = 2, 32
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        targets = tokens[:, 1:].reshape(-1)
        ops.softmax_cross_entropy(logits.reshape(-1, config.vocab_size), targets).backward()
    counted = counter.get_total_flops() / (batch * seq)
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    masked_half = attention_flops_per_token(
        n_layers=config.n_layers, n_heads=config.n_heads, head_dim=config.head_dim, seq_len=seq
    )
    assert counted == moe_flops_per_token(config, seq) - 6 * norms + masked_half
    all_experts = 6 * (config.num_params(True) - config.num_active_params(True))
    assert all_experts > 0  # the formula is not the total-parameter one
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    assert linear < config.num_active_params(True)


def test_capacity_drops_the_latest_assignments_per_sequence(plugins: Plugins) -> None:
    layer = _build(plugins, capacity_factor=1.0, top_k=1).layers["0"].feed_forward
    assert isinstance(layer, MoELayer)
    # One sequence of 8 positions all choosing expert 2: capacity ceil(1·8·1/4) = 2.
    chosen = torch.full((1, 8, 1), 2)
    keep = layer.kept(chosen)
    assert keep[0, :, 0].tolist() == [True, True] + [False] * 6
    # Two sequences are separate routing groups.
    keep = layer.kept(torch.full((2, 8, 1), 2))
    assert keep.sum().item() == 4


def test_balance_loss_reaches_router_gradients(plugins: Plugins) -> None:
    tokens = torch.randint(0, 256, (2, 16))
    grads = []
    for coef in (0.0, 1.0):
        model = _build(plugins, aux_loss_coef=coef)
        model(tokens).float().sum().mul(0).backward()  # only the balancing loss has a gradient
        grads.append(model.layers["0"].feed_forward.router.weight.grad.norm().item())
    assert grads[0] == 0.0 and grads[1] > 0.0


def _skewed_inputs(dim: int, steps: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    direction = torch.randn(dim, generator=generator)
    return [torch.randn(4, 32, dim, generator=generator) + direction for _ in range(steps)]


def _skew_router(layer: MoELayer, x: torch.Tensor) -> None:
    """Point expert 0's router row along the inputs' mean, so it takes most tokens."""
    with torch.no_grad():
        mean = x.mean(dim=(0, 1))
        layer.router.weight.normal_(0, 0.02)
        layer.router.weight[0] += mean / mean.square().sum() * 2.0  # logit +2 on average


def _imbalance(layer: MoELayer, held_out: list[torch.Tensor]) -> float:
    """max / mean of the per-expert load over a few batches the balancing never saw."""
    layer.tokens_per_expert.zero_()
    with torch.no_grad():
        for x in held_out:
            layer(x)
    load = layer.tokens_per_expert
    return (load.max() / load.mean()).item()


def test_auxiliary_loss_flattens_a_skewed_load(plugins: Plugins) -> None:
    layer = _build(plugins, aux_loss_coef=1.0, num_experts=8, top_k=2).layers["0"].feed_forward
    assert isinstance(layer, MoELayer)
    inputs = _skewed_inputs(layer.config.dim, 64)
    inputs, held_out = inputs[:60], inputs[60:]
    _skew_router(layer, inputs[0])
    before = _imbalance(layer, held_out)
    optimizer = torch.optim.SGD(layer.router.parameters(), lr=0.01)
    for x in inputs:
        layer(x).sum().mul(0).backward()  # the balancing loss alone
        optimizer.step()
        optimizer.zero_grad()
    after = _imbalance(layer, held_out)
    print(f"aux loss: max/mean load {before:.2f} -> {after:.2f}")
    assert before > 2.0 and after < 0.6 * before


def test_bias_update_flattens_a_skewed_load(plugins: Plugins) -> None:
    layer = (
        _build(plugins, aux_loss_coef=0.0, bias_update_rate=0.01, num_experts=8, top_k=2)
        .layers["0"]
        .feed_forward
    )
    assert isinstance(layer, MoELayer)
    inputs = _skewed_inputs(layer.config.dim, 64)
    inputs, held_out = inputs[:60], inputs[60:]
    _skew_router(layer, inputs[0])
    before = _imbalance(layer, held_out)
    for x in inputs:
        layer.tokens_per_expert.zero_()
        with torch.no_grad():
            layer(x)
        layer.update_expert_bias(layer.tokens_per_expert)
    after = _imbalance(layer, held_out)
    print(f"bias update: max/mean load {before:.2f} -> {after:.2f}")
    assert before > 2.0 and after < 0.6 * before


class _Recorder:
    """Stands in for the plugin manager: keeps the requests the comm facade issues."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    def communicate(self, request: Any) -> None:
        self.requests.append(request)


def test_all_to_all_carries_checked_split_sizes() -> None:
    from plait.core.comm import INPUT_SPLIT_SIZES, OUTPUT_SPLIT_SIZES, Comm, Group

    recorder = _Recorder()
    comm = Comm(recorder)  # type: ignore[arg-type]
    group = Group(name="ep", ranks=(0, 1))
    out, x = torch.empty(5, 2), torch.empty(3, 2)
    comm.all_to_all(out, x, group=group, input_split_sizes=[0, 3], output_split_sizes=[4, 1])
    (request,) = recorder.requests
    assert request.attributes == {INPUT_SPLIT_SIZES: [0, 3], OUTPUT_SPLIT_SIZES: [4, 1]}
    comm.all_to_all(torch.empty(4, 2), torch.empty(4, 2), group=group)
    assert recorder.requests[-1].attributes == {}  # equal blocks: no sizes
    with pytest.raises(ValueError, match=r"input_split_sizes \[1, 1\].*summing to dim 0.*3"):
        comm.all_to_all(out, x, group=group, input_split_sizes=[1, 1])
    with pytest.raises(ValueError, match=r"output_split_sizes \[5\]: needs 2"):
        comm.all_to_all(out, x, group=group, output_split_sizes=[5])
