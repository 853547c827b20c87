"""The built-in model families: shapes, grouped-query attention, the parallelism contract
(pipeline-stage forwards, name-keyed init, run-time head counts, tp_plan), presets and errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from plait.core.errors import ConfigError
from plait.core.hookspecs import hookimpl
from plait.core.kernels import Kernels
from plait.plugins.kernels_torch import ops
from plait.plugins.models import GPT2, Llama, resolve_model_config

FAMILIES = ("llama", "gpt2")


@pytest.fixture
def kernels(plugins) -> Kernels:
    return Kernels(plugins)


def _build(plugins, kernels: Kernels, family: str, size: str = "tiny", **overrides) -> nn.Module:
    config = resolve_model_config(family, size, overrides)
    return plugins.model(family).build(config, kernels)


def _tokens(batch: int = 2, seq: int = 12, vocab: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_both_families_are_registered_with_presets(plugins) -> None:
    models = plugins.models()
    assert models["llama"][1].presets == ("tiny", "small", "1b", "7b", "70b")
    assert models["gpt2"][1].presets == ("tiny", "small", "medium", "large")
    assert models["llama"][0] == models["gpt2"][0] == "models"
    config = models["llama"][1].make_config("tiny", {"n_layers": 3})
    assert config == resolve_model_config("llama", "tiny", {"n_layers": 3})
    with pytest.raises(ConfigError, match="allowed: tiny, small, medium, large"):
        models["gpt2"][1].make_config("xl", {})


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_gives_logits_per_position(plugins, kernels, family: str) -> None:
    model = _build(plugins, kernels, family)
    logits = model(_tokens())
    assert logits.shape == (2, 12, 256)
    assert torch.isfinite(logits).all()
    # Causal: changing a later token leaves earlier positions' logits untouched.
    tokens = _tokens()
    changed = tokens.clone()
    changed[:, 8] = (changed[:, 8] + 1) % 256
    torch.testing.assert_close(model(changed)[:, :8], model(tokens)[:, :8])
    assert not torch.allclose(model(changed)[:, 8:], model(tokens)[:, 8:])


@pytest.mark.parametrize("family", FAMILIES)
def test_a_few_steps_fit_a_fixed_batch(plugins, kernels, family: str) -> None:
    torch.manual_seed(0)
    model = _build(plugins, kernels, family)
    tokens = _tokens(batch=4, seq=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(8):
        logits = model(tokens[:, :-1])
        loss = ops.softmax_cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)
    assert losses[-1] < losses[0] - 0.5


def test_llama_grouped_query_attention_equals_mha_with_repeated_kv(plugins, kernels) -> None:
    gqa = _build(plugins, kernels, "llama")
    config = gqa.config
    assert config.n_heads == 4 and config.kv_heads == 2
    attention = gqa.layers["0"].attention
    assert attention.wk.out_features == config.kv_heads * config.head_dim
    mha = _build(plugins, kernels, "llama", n_kv_heads=4)
    state = gqa.state_dict()
    group = config.n_heads // config.kv_heads
    for name, value in state.items():
        if name.endswith(("attention.wk.weight", "attention.wv.weight")):
            # Each kv head's rows are shared by `group` consecutive query heads.
            heads = value.view(config.kv_heads, config.head_dim, config.dim)
            state[name] = heads.repeat_interleave(group, dim=0).reshape(-1, config.dim)
    mha.load_state_dict(state)
    tokens = _tokens()
    torch.testing.assert_close(mha(tokens), gqa(tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_reads_local_head_count_from_sharded_weights(
    plugins, kernels, family: str
) -> None:
    """Column-sharding wq/wk/wv and row-sharding wo by heads, as tensor parallelism does, gives
    partial outputs that sum to the unsharded output without changing the module code."""
    model = _build(plugins, kernels, family)
    attention = model.layers["0"].attention
    head_dim = attention.head_dim
    x = torch.randn(2, 6, model.config.dim, generator=torch.Generator().manual_seed(3))
    cos = sin = None
    if family == "llama":
        cos, sin = model.rope_cos[:6], model.rope_sin[:6]
    full = attention(x, cos, sin)
    tp = 2
    partial_sum = torch.zeros_like(full)
    for rank in range(tp):
        shard = copy.deepcopy(attention)
        for name in ("wq", "wk", "wv"):
            linear = getattr(shard, name)
            rows = linear.out_features // tp
            new = nn.Linear(linear.in_features, rows, bias=linear.bias is not None)
            new.weight.data = linear.weight.data[rank * rows : (rank + 1) * rows]
            if linear.bias is not None:
                new.bias.data = linear.bias.data[rank * rows : (rank + 1) * rows]
            setattr(shard, name, new)
        cols = shard.wo.in_features // tp
        wo = nn.Linear(cols, shard.wo.out_features, bias=False)
        wo.weight.data = shard.wo.weight.data[:, rank * cols : (rank + 1) * cols]
        shard.wo = wo
        assert shard.wq.out_features // head_dim == model.config.n_heads // tp
        partial_sum += shard(x, cos, sin)
    if attention.wo.bias is not None:
        partial_sum += attention.wo.bias
    torch.testing.assert_close(partial_sum, full, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_stages_compose_to_the_full_model(plugins, kernels, family: str) -> None:
    full = _build(plugins, kernels, family)
    first, second = copy.deepcopy(full), copy.deepcopy(full)
    del first.layers["1"]
    first.norm = first.output = None
    del second.layers["0"]
    second.tok_embeddings = None
    if family == "gpt2":
        second.pos_embeddings = None
    tokens = _tokens()
    hidden = first(tokens)
    assert hidden.shape == (2, 12, full.config.dim)
    torch.testing.assert_close(second(hidden), full(tokens))
    assert next(iter(second.state_dict())).startswith("layers.1.")


@pytest.mark.parametrize("family", FAMILIES)
def test_meta_built_stage_initialises_like_the_full_model(plugins, kernels, family: str) -> None:
    full = _build(plugins, kernels, family, n_layers=3)
    full.init_weights(seed=11)
    with torch.device("meta"):
        stage = _build(plugins, kernels, family, n_layers=3)
    assert all(p.is_meta for p in stage.parameters())
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.to_empty(device="cpu")
    stage.init_weights(seed=11)
    full_params = dict(full.named_parameters())
    stage_params = dict(stage.named_parameters())
    assert stage_params and set(stage_params) < set(full_params)
    for name, param in stage_params.items():
        assert torch.equal(param, full_params[name]), name
    if family == "llama":
        assert torch.equal(stage.rope_cos, full.rope_cos)
        assert torch.equal(stage.rope_sin, full.rope_sin)


def test_init_values_follow_the_documented_rules(plugins, kernels) -> None:
    model = _build(plugins, kernels, "gpt2", dim=256, n_heads=4, n_layers=8)
    model.init_weights(seed=5)
    params = dict(model.named_parameters())
    assert torch.equal(params["layers.0.attention_norm.weight"], torch.ones(256))
    assert torch.equal(params["norm.bias"], torch.zeros(256))
    assert torch.equal(params["layers.3.feed_forward.w1_bias"], torch.zeros(1024))
    assert params["layers.2.attention.wq.weight"].std().item() == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / (2 * 8) ** 0.5
    assert params["layers.2.feed_forward.w2.weight"].std().item() == pytest.approx(scaled, rel=0.02)
    assert params["layers.2.attention.wo.weight"].std().item() == pytest.approx(scaled, rel=0.02)
    # Different names and different seeds give different values.
    assert not torch.equal(
        params["layers.0.attention.wq.weight"], params["layers.1.attention.wq.weight"]
    )
    before = params["output.weight"].clone()
    model.init_weights(seed=6)
    assert not torch.equal(before, params["output.weight"])
    model.init_weights(seed=5)
    assert torch.equal(before, params["output.weight"])


def test_init_ignores_activation_checkpoint_wrappers(plugins, kernels) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    plain = _build(plugins, kernels, "llama")
    wrapped = _build(plugins, kernels, "llama")
    wrapped.layers["1"] = checkpoint_wrapper(wrapped.layers["1"])
    plain.init_weights(seed=3)
    wrapped.init_weights(seed=3)
    wrapped_params = {
        name.replace("_checkpoint_wrapped_module.", ""): p for name, p in wrapped.named_parameters()
    }
    for name, param in plain.named_parameters():
        assert torch.equal(param, wrapped_params[name]), name
    torch.testing.assert_close(wrapped(_tokens()), plain(_tokens()))


@pytest.mark.parametrize("family", FAMILIES)
def test_tp_plan_names_existing_modules_of_the_right_kind(plugins, kernels, family: str) -> None:
    model = _build(plugins, kernels, family)
    modules = dict(model.named_modules())
    for pattern, style in model.tp_plan.items():
        names = [pattern.replace("*", str(i)) for i in range(model.config.n_layers)]
        for name in dict.fromkeys(names):
            expected = nn.Embedding if style == "vocab" else nn.Linear
            assert isinstance(modules[name], expected), (pattern, style)
            assert style in ("colwise", "rowwise", "vocab")
    params = dict(model.named_parameters())
    for pattern in model.tp_param_plan:
        assert pattern.replace("*", "0") in params
    assert "pos_embeddings" not in model.tp_plan


def test_models_fetch_every_op_from_the_kernel_facade(plugins) -> None:
    calls: list[str] = []

    class Spy:
        @hookimpl
        def plait_kernel(self, name, device, dtype, provider):
            if provider != "spy":
                return None
            reference = ops.OPS[name]

            def traced(*args, **kwargs):
                calls.append(name)
                return reference(*args, **kwargs)

            return traced

    plugins.register(Spy(), "spy")
    kernels = Kernels(plugins, prefer=["spy"])
    _build(plugins, kernels, "llama")(_tokens())
    _build(plugins, kernels, "gpt2")(_tokens())
    assert set(calls) == {"rms_norm", "rope", "attention", "swiglu", "layer_norm", "bias_gelu"}


@pytest.mark.parametrize(
    ("family", "size", "total"),
    [
        ("llama", "7b", 6_738_415_616),  # Llama-2-7B
        ("llama", "70b", 68_976_648_192),  # Llama-2-70B
        ("llama", "1b", 1_100_048_384),  # TinyLlama-1.1B
        ("gpt2", "small", 124_439_808 + 50257 * 768),  # GPT-2 124M + an untied output matrix
    ],
)
def test_presets_have_the_published_parameter_counts(
    plugins, kernels, family: str, size: str, total: int
) -> None:
    config = resolve_model_config(family, size)
    assert config.num_params() == total
    if size != "70b":  # building 80 layers on meta takes a while; the formula is checked above
        with torch.device("meta"):
            model = plugins.model(family).build(config, kernels)
        assert model.num_params() == total
        assert model.num_params(exclude_embeddings=True) == config.num_params(True)


def test_llama_presets_have_the_real_feed_forward_widths() -> None:
    assert resolve_model_config("llama", "7b").hidden_dim == 11008
    seventy = resolve_model_config("llama", "70b")
    assert (seventy.hidden_dim, seventy.n_heads, seventy.kv_heads) == (28672, 64, 8)


def test_overrides_apply_and_validate() -> None:
    config = resolve_model_config("llama", "tiny", {"n_layers": 3, "vocab_size": 512})
    assert (config.n_layers, config.vocab_size, config.dim) == (3, 512, 64)
    assert resolve_model_config("gpt2", "tiny").vocab_size == 256


def test_unknown_preset_names_the_allowed_ones() -> None:
    with pytest.raises(ConfigError, match=r"no preset '13b'.*tiny, small, 1b, 7b, 70b"):
        resolve_model_config("llama", "13b")


def test_unknown_override_field_names_the_allowed_fields() -> None:
    with pytest.raises(ConfigError, match=r"no field\(s\) hidden.*allowed: vocab_size, dim"):
        resolve_model_config("gpt2", "tiny", {"hidden": 12})


def test_unknown_family_and_bad_values_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="allowed: llama, gpt2"):
        resolve_model_config("mamba", "tiny")
    with pytest.raises(ConfigError, match="not a multiple of n_kv_heads"):
        resolve_model_config("llama", "tiny", {"n_kv_heads": 3})
    with pytest.raises(ConfigError, match="n_layers"):
        resolve_model_config("llama", "tiny", {"n_layers": 0})


def test_sequence_longer_than_max_seq_len_is_rejected(plugins, kernels) -> None:
    model = _build(plugins, kernels, "llama", max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len 8"):
        model(_tokens(seq=9))


def test_module_classes_are_the_families(plugins, kernels) -> None:
    assert isinstance(_build(plugins, kernels, "llama"), Llama)
    assert isinstance(_build(plugins, kernels, "gpt2"), GPT2)


def _tensor_parallel_llama_matches_the_full_model(rank: int, world_size: int) -> dict[str, float]:
    """On each rank: build on meta, shard by `Llama.tp_plan` with DTensor TP, materialise and
    init; compare parameters and logits with an unsharded model initialised with the same seed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from plait.core.plugins import Plugins

    kernels = Kernels(Plugins.create(autoload=False))
    config = resolve_model_config("llama", "tiny")
    full = Llama(config, kernels)
    full.init_weights(seed=3)
    with torch.device("meta"):
        model = Llama(config, kernels)
    styles = {
        "colwise": ColwiseParallel(),
        "rowwise": RowwiseParallel(),
        "vocab": RowwiseParallel(input_layouts=Replicate()),
    }
    plan = {pattern: styles[style] for pattern, style in Llama.tp_plan.items()}
    plan["output"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, init_device_mesh("cpu", (world_size,)), plan)
    model.to_empty(device="cpu")
    model.init_weights(seed=3)
    full_params = dict(full.named_parameters())
    sharded = 0
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            sharded += 1
            assert param.to_local().numel() * world_size == param.numel(), name
            param = param.full_tensor()
        assert torch.equal(param, full_params[name]), name
    tokens = _tokens()
    with torch.no_grad():
        difference = (model(tokens) - full(tokens)).abs().max().item()
    return {"sharded": float(sharded), "max_logit_difference": difference}


@pytest.mark.dist
def test_tensor_parallel_plan_init_and_forward_on_two_ranks() -> None:
    from plait.testing.distributed import run_distributed

    results = run_distributed(_tensor_parallel_llama_matches_the_full_model, 2, timeout=120)
    for result in results:
        assert result["sharded"] == 2 + 2 * 7  # embeddings, output, 7 per layer
        assert result["max_logit_difference"] < 1e-5
