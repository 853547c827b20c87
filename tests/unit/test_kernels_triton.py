"""The Triton kernel provider: every op forward and backward against the torch reference under
the Triton interpreter, provider selection, and a tiny Llama trained with Triton kernels forced.

Shapes are odd and non-power-of-two on purpose (masking, partial tiles, several vocabulary
chunks and attention tiles). Everything is fp32; tolerances are stated per op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch

import plait.plugins.kernels_triton as kernels_triton
from plait.core.kernels import KERNEL_OPS, Kernels
from plait.core.plugins import Plugins
from plait.plugins.kernels_torch import ops as reference
from plait.plugins.kernels_triton.attention import attention
from plait.plugins.kernels_triton.cross_entropy import softmax_cross_entropy
from tests.unit.triton_interpreter import interpreted_only

pytestmark = [
    pytest.mark.triton,
    # The interpreter runs on numpy, which warns when exp saturates to inf; the kernels rely on
    # that saturation (sigmoid tails), as GPU exp does silently.
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    interpreted_only,
]

FP32 = {"atol": 1e-5, "rtol": 1e-4}
# Attention sums over tiles in a different order than SDPA's single softmax.
ATTENTION_TOL = {"atol": 2e-5, "rtol": 2e-4}


def _leaves(shapes: Sequence[tuple[int, ...]], seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]


def _compare(
    triton_fn: Callable[..., torch.Tensor],
    reference_fn: Callable[..., torch.Tensor],
    shapes: Sequence[tuple[int, ...]],
    *,
    seed: int = 0,
    tol: dict[str, float] = FP32,
) -> None:
    """Forward outputs and every input gradient of the two implementations must agree."""
    ours = _leaves(shapes, seed)
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    out, expected = triton_fn(*ours), reference_fn(*theirs)
    torch.testing.assert_close(out, expected, **tol)
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1))
    out.backward(upstream)
    expected.backward(upstream)
    for index, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
        assert mine.grad is not None and ref.grad is not None, f"input {index} has no gradient"
        torch.testing.assert_close(mine.grad, ref.grad, **tol, msg=f"gradient of input {index}")


def _kernel(name: str) -> Callable[..., torch.Tensor]:
    return kernels_triton.load_kernel(name)


# --------------------------------------------------------------------------------------------
# kernels vs the torch reference
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(3, 7, 37), (5, 100)])
def test_rms_norm_matches_reference(shape: tuple[int, ...]) -> None:
    rms_norm = _kernel("rms_norm")
    _compare(
        lambda x, w: rms_norm(x, w, 1e-5),
        lambda x, w: reference.rms_norm(x, w, 1e-5),
        [shape, shape[-1:]],
    )


@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_norm_matches_reference(with_bias: bool) -> None:
    layer_norm = _kernel("layer_norm")
    shapes = [(2, 9, 45), (45,), (45,)] if with_bias else [(2, 9, 45), (45,)]
    _compare(
        lambda x, w, *b: layer_norm(x, w, b[0] if b else None, 1e-5),
        lambda x, w, *b: reference.layer_norm(x, w, b[0] if b else None, 1e-5),
        shapes,
        seed=3,
    )


def test_swiglu_matches_reference() -> None:
    _compare(_kernel("swiglu"), reference.swiglu, [(3, 11, 173), (3, 11, 173)], seed=5)


def test_bias_gelu_matches_reference() -> None:
    # Scaled inputs reach the tails of tanh. There fp32 `F.gelu` itself rounds 1 + tanh to 0,
    # so the reference is computed in fp64 (the kernel rewrites 1 ± tanh as sigmoids).
    def ours(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return _kernel("bias_gelu")(x * 4.0, bias)

    def theirs(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        return reference.bias_gelu(x.double() * 4.0, bias.double()).float()

    _compare(ours, theirs, [(4, 7, 99), (99,)], seed=7)


def test_rope_matches_reference_on_strided_heads() -> None:
    rope = _kernel("rope")
    batch, seq, heads, head_dim = 2, 13, 3, 10
    angles = torch.rand(seq, head_dim // 2, generator=torch.Generator().manual_seed(1)) * 6
    cos, sin = angles.cos(), angles.sin()

    # Take heads out of a fused projection so x is not contiguous, as q and k often are.
    def strided(fn: Callable[..., torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda fused: fn(fused[..., :heads, :], cos, sin)

    _compare(strided(rope), strided(reference.rope), [(batch, seq, heads + 2, head_dim)], seed=9)


@pytest.mark.parametrize(
    ("rows", "vocab", "vocab_block"), [(13, 1003, 256), (6, 77, 4096)], ids=["chunked", "one"]
)
def test_softmax_cross_entropy_matches_reference(rows: int, vocab: int, vocab_block: int) -> None:
    targets = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(2))
    targets[[1, 4]] = -100  # ignored rows: no loss, zero gradient, not in the mean

    def ours(logits: torch.Tensor) -> torch.Tensor:
        return softmax_cross_entropy(logits * 3.0, targets, -100, vocab_block=vocab_block)

    def theirs(logits: torch.Tensor) -> torch.Tensor:
        return reference.softmax_cross_entropy(logits * 3.0, targets, -100)

    _compare(ours, theirs, [(rows, vocab)], seed=11, tol={"atol": 1e-6, "rtol": 1e-5})


def test_softmax_cross_entropy_keeps_only_the_logits_and_all_ignored_is_nan() -> None:
    logits = torch.randn(5, 67, requires_grad=True)
    targets = torch.full((5,), -100)
    loss = softmax_cross_entropy(logits, targets)
    assert torch.isnan(loss), "mean over zero targets must be nan, as torch's reduction is"
    targets[2] = 3
    loss = softmax_cross_entropy(logits, targets, vocab_block=16)
    # Between forward and backward: the logits themselves and per-row numbers, no softmax and
    # no gradient buffer.
    saved = loss.grad_fn.saved_tensors
    assert [t.numel() for t in saved if t.numel() >= logits.shape[1]] == [logits.numel()]
    assert any(t.data_ptr() == logits.data_ptr() for t in saved)
    loss.backward(torch.tensor(2.0), retain_graph=True)
    expected = torch.zeros_like(logits)
    expected[2] = 2.0 * (torch.softmax(logits[2].detach(), -1) - torch.eye(67)[3])
    torch.testing.assert_close(logits.grad, expected, atol=1e-6, rtol=1e-5)
    # The gradient is made by the backward, from the incoming gradient: a second backward
    # through the same graph adds it again.
    loss.backward(torch.tensor(-0.5))
    torch.testing.assert_close(logits.grad, expected * 0.75, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "seq", "head_dim", "causal"),
    [
        (2, 4, 2, 37, 24, True),  # grouped-query, partial last tile, head_dim not a power of 2
        (1, 3, 1, 21, 10, True),  # multi-query, head_dim below the 16-wide minimum tile
        (1, 2, 2, 19, 16, False),  # plain multi-head, no mask
    ],
)
def test_attention_matches_reference(
    batch: int, heads: int, kv_heads: int, seq: int, head_dim: int, causal: bool
) -> None:
    shapes = [(batch, heads, seq, head_dim), *[(batch, kv_heads, seq, head_dim)] * 2]
    _compare(
        # 16-wide tiles so several query and key blocks, and the diagonal, are exercised.
        lambda q, k, v: attention(q, k, v, causal, block_m=16, block_n=16),
        lambda q, k, v: reference.attention(q, k, v, causal),
        shapes,
        seed=13,
        tol=ATTENTION_TOL,
    )


def test_attention_with_unequal_tiles_and_transposed_inputs() -> None:
    # (batch, seq, heads, dim) projections transposed to (batch, heads, seq, dim), as models do.
    def transposed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        return lambda q, k, v: fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    _compare(
        transposed(lambda q, k, v: attention(q, k, v, True, block_m=32, block_n=16)),
        transposed(lambda q, k, v: reference.attention(q, k, v, True)),
        [(1, 33, 4, 16), (1, 33, 2, 16), (1, 33, 2, 16)],
        seed=17,
        tol=ATTENTION_TOL,
    )


@pytest.mark.parametrize("op", ["attention", "rms_norm", "softmax_cross_entropy", "swiglu"])
def test_float16_inputs_agree_with_an_fp32_reference(op: str) -> None:
    # Half-precision tiles take other code paths (casts before tl.dot, stores in the input
    # dtype). fp16 rather than bf16: the interpreter runs on numpy, which has no bfloat16.
    def inputs() -> tuple[list[torch.Tensor], Callable[..., torch.Tensor]]:
        g = torch.Generator().manual_seed(23)
        if op == "attention":
            shapes = [(1, 4, 21, 16), (1, 2, 21, 16), (1, 2, 21, 16)]
            return [torch.randn(s, generator=g) for s in shapes], lambda q, k, v: (q, k, v)
        if op == "rms_norm":
            tensors = [torch.randn(5, 37, generator=g), torch.randn(37, generator=g)]
            return tensors, lambda x, w: (x, w, 1e-5)
        if op == "softmax_cross_entropy":
            targets = torch.randint(0, 77, (6,), generator=g)
            return [torch.randn(6, 77, generator=g)], lambda x: (x, targets)
        return [torch.randn(3, 41, generator=g), torch.randn(3, 41, generator=g)], lambda *x: x

    tensors, arguments = inputs()
    half = [t.half().requires_grad_() for t in tensors]
    full = [t.half().float().requires_grad_() for t in tensors]
    out = _kernel(op)(*arguments(*half))
    expected = getattr(reference, op)(*arguments(*full))
    assert out.dtype == (torch.float32 if op == "softmax_cross_entropy" else torch.float16)
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)
    out.float().sum().backward()
    expected.sum().backward()
    for mine, ref in zip(half, full, strict=True):
        assert mine.grad is not None and mine.grad.dtype == torch.float16
        torch.testing.assert_close(mine.grad.float(), ref.grad, atol=2e-2, rtol=2e-2)


def test_adamw_step_matches_reference_over_steps() -> None:
    generator = torch.Generator().manual_seed(19)
    shapes = [(37, 5), (1001,), (3, 4, 7)]
    params = [torch.randn(s, generator=generator) for s in shapes]
    # A transposed view exercises the copy-back path for non-contiguous tensors.
    params.append(torch.randn(6, 9, generator=generator).t())
    ref_params = [p.clone() for p in params]
    initial = [p.clone() for p in params]
    state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    ref_state = [[torch.zeros_like(p) for p in params] for _ in range(2)]
    hyper = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    adamw_step = _kernel("adamw_step")
    for step in range(1, 4):
        grads = [torch.randn(p.shape, generator=generator) for p in params]
        adamw_step(params, grads, *state, step=step, **hyper)
        reference.adamw_step(ref_params, grads, *ref_state, step=step, **hyper)
    mine = [*params, *state[0], *state[1]]
    theirs = [*ref_params, *ref_state[0], *ref_state[1]]
    for index, (ours, ref) in enumerate(zip(mine, theirs, strict=True)):
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-5, msg=f"tensor {index}")
    moved = [(p - p0).abs().max().item() for p, p0 in zip(params, initial, strict=True)]
    assert min(moved) > 1e-3, f"the update did not move every parameter: {moved}"


# --------------------------------------------------------------------------------------------
# provider selection
# --------------------------------------------------------------------------------------------


@pytest.fixture
def plugins_with_triton() -> Plugins:
    plugins = Plugins.create(autoload=False)
    if plugins.manager.get_plugin("kernels_triton") is None:
        plugins.register(kernels_triton, "kernels_triton")
    return plugins


def test_registers_every_op_for_cuda_and_interpreted_cpu(plugins_with_triton: Plugins) -> None:
    records = [r for _, r in plugins_with_triton.kernel_records() if r.provider == "triton"]
    assert sorted(r.op for r in records) == sorted(KERNEL_OPS)
    assert all(r.device_types == ("cuda", "cpu") for r in records)


def test_cpu_prefers_torch_unless_triton_is_asked_for(plugins_with_triton: Plugins) -> None:
    default = Kernels(plugins_with_triton, prefer=["torch"])
    forced = Kernels(plugins_with_triton, prefer=["triton", "torch"])
    override = Kernels(plugins_with_triton, prefer=["torch"], overrides={"attention": "triton"})
    for op in KERNEL_OPS:
        assert default.provider_of(op, "cpu", torch.float32) == "torch"
        assert forced.provider_of(op, "cpu", torch.float32) == "triton"
        assert forced.get(op, "cpu", torch.float32).plait_provider == "triton"
        assert override.provider_of(op, "cpu", "float32") == (
            "triton" if op == "attention" else "torch"
        )
    # No preference at all: on CPU the interpreter never volunteers.
    assert Kernels(plugins_with_triton).provider_of("rms_norm", "cpu", "float32") == "torch"
    # Unsupported dtypes fall through to the reference.
    assert forced.provider_of("rms_norm", "cpu", torch.float64) == "torch"


def test_without_interpreter_only_cuda_is_answered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hook = kernels_triton.plait_kernel
    assert hook("rms_norm", "cpu", "float32", "triton") is None
    assert hook("rms_norm", "cuda", "float32", None) is not None
    assert hook("rms_norm", "cuda", "float32", "torch") is None
    assert all(r.device_types == ("cuda",) for r in kernels_triton.plait_register_kernels())


def test_kernels_command_lists_the_configured_provider_per_device() -> None:
    from typer.testing import CliRunner

    from plait.tools.kernels_commands import app, resolve_providers

    chosen, installed, prefer = resolve_providers(
        None, ["kernels.prefer=['triton', 'torch']", "kernels.overrides={rope = 'torch'}"]
    )
    assert prefer == ["triton", "torch"]
    assert chosen["attention"] == {"cpu": "triton", "cuda": "triton"}
    assert chosen["rope"] == {"cpu": "torch", "cuda": "torch"}
    assert "triton (cuda, cpu)" in installed["rms_norm"]
    result = CliRunner().invoke(
        app, ["--set", "kernels.overrides={swiglu = 'nothing'}"], env={"COLUMNS": "200"}
    )
    assert result.exit_code == 0, result.output
    assert "unresolved" in result.output and "'nothing'" in result.output
    for op in KERNEL_OPS:
        assert op in result.output
    # Each cell says how the chosen provider's op sits in a compiled block.
    result = CliRunner().invoke(
        app, ["--set", "kernels.prefer=['triton', 'torch']"], env={"COLUMNS": "200"}
    )
    rows = {line.split("│")[1].strip(): line for line in result.output.splitlines() if "│" in line}
    assert "triton · custom op" in rows["rms_norm"] and "triton · graph break" in rows["grouped_mm"]
    result = CliRunner().invoke(app, ["--set", "kernels.prefer=['torch']"], env={"COLUMNS": "200"})
    assert "torch · traced" in result.output, result.output


# --------------------------------------------------------------------------------------------
# a training run
# --------------------------------------------------------------------------------------------


def _train_losses(kernels: Kernels, steps: int) -> list[float]:
    from plait.core.optim import AdamW
    from plait.plugins.models import resolve_model_config

    torch.manual_seed(0)
    record = kernels.plugins.model("llama")
    config = resolve_model_config("llama", "tiny", {"n_layers": 1, "max_seq_len": 32})
    model = record.build(config, kernels)
    model.init_weights(seed=7)
    optimizer = AdamW(model.parameters(), kernels=kernels, lr=3e-3, weight_decay=0.1)
    tokens = torch.randint(
        0, config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3)
    )
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    losses = []
    for _ in range(steps):
        logits = model(inputs)
        cross_entropy = kernels.get("softmax_cross_entropy", logits.device, logits.dtype)
        loss = cross_entropy(logits.reshape(-1, logits.shape[-1]), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def test_tiny_llama_trains_to_the_same_losses_with_triton_kernels(
    plugins_with_triton: Plugins,
) -> None:
    pytest.importorskip("plait.plugins.models.llama")
    steps = 3
    with_torch = _train_losses(Kernels(plugins_with_triton, prefer=["torch"]), steps)
    forced = Kernels(plugins_with_triton, prefer=["triton", "torch"])
    with_triton = _train_losses(forced, steps)
    for op in ("rms_norm", "rope", "attention", "swiglu", "softmax_cross_entropy", "adamw_step"):
        assert forced.provider_of(op, "cpu", torch.float32) == "triton", op
    assert with_torch[-1] < with_torch[0], f"the reference run did not learn: {with_torch}"
    torch.testing.assert_close(with_triton, with_torch, atol=2e-5, rtol=1e-5)
