"""fp8 linear layers (`amp.fp8`): the three GEMMs go through `torch._scaled_mm` (which also runs
on CPU, so the numerics are tested here), results stay close to the full-precision layer, a tiny
Llama trains to the same loss, and the option is refused where fp8 tensor cores are missing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import plait
from plait.core.errors import ConfigError
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins.models import resolve_model_config
from plait.plugins.models.llama import build_llama
from plait.plugins.precision.fp8 import Float8Linear, convert_to_float8


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.float() - expected.float()).norm() / expected.float().norm()).item()


def test_all_three_gemms_run_in_fp8_close_to_the_linear(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(96, 160)
    reference = nn.Linear(96, 160)
    reference.load_state_dict(linear.state_dict())
    (swapped,) = convert_to_float8(nn.Sequential(linear))
    assert swapped == "0" and isinstance(linear, Float8Linear)
    calls: list[tuple[torch.dtype, torch.dtype]] = []
    scaled_mm = torch._scaled_mm

    def counting(a: torch.Tensor, b: torch.Tensor, **kwargs: object) -> torch.Tensor:
        calls.append((a.dtype, b.dtype))
        return scaled_mm(a, b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", counting)
    # Magnitudes beyond e4m3's range (448) and gradients below e5m2's smallest value (1.5e-5):
    # only the per-tensor scales keep them.
    x = torch.randn(4, 33, 96) * 1e3
    x_ref = x.clone().requires_grad_()
    x.requires_grad_()
    out, expected = linear(x), reference(x_ref)
    upstream = torch.randn(out.shape) * 1e-7
    out.backward(upstream)
    expected.backward(upstream)
    e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
    assert calls == [(e4m3, e4m3), (e5m2, e4m3), (e5m2, e4m3)], calls
    # e4m3 keeps 3 mantissa bits, e5m2 two: errors of a few percent, averaged by the sums.
    assert _relative_error(out, expected) < 0.05
    assert _relative_error(x.grad, x_ref.grad) < 0.1
    assert _relative_error(linear.weight.grad, reference.weight.grad) < 0.1
    assert _relative_error(linear.bias.grad, reference.bias.grad) < 1e-5  # not through fp8


def test_layers_that_do_not_fit_or_are_skipped_stay_linear() -> None:
    model = nn.ModuleDict(
        {"a": nn.Linear(32, 48), "odd": nn.Linear(30, 48), "output": nn.Linear(32, 64)}
    )
    assert convert_to_float8(model, skip=["output"]) == ["a"]
    assert type(model["odd"]) is nn.Linear and type(model["output"]) is nn.Linear


def _scaled_mm_in_fp32(
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """What `torch._scaled_mm` computes (fp8 operands, fp32 accumulation, both scales), through
    fp32 matmuls: its CPU kernel takes ~40 ms per call at these sizes, two orders of magnitude
    slower, and would make the training comparison below take minutes."""
    return ((a.float() @ b.float()) * (scale_a * scale_b)).to(out_dtype)


def test_the_fp32_emulation_computes_what_scaled_mm_computes() -> None:
    torch.manual_seed(0)
    a, b = torch.randn(48, 64) * 30, torch.randn(32, 64) * 0.02
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    scale_a, scale_b = torch.tensor(0.5), torch.tensor(3.0)
    expected = torch._scaled_mm(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    got = _scaled_mm_in_fp32(a8, b8, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def _train(fp8: bool, steps: int) -> list[float]:
    torch.manual_seed(0)
    overrides = {"dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "max_seq_len": 32}
    config = resolve_model_config("llama", "tiny", overrides)
    model = build_llama(config, Kernels(Plugins.create(autoload=False), prefer=["torch"]))
    if fp8:
        assert len(convert_to_float8(model, skip=["output"])) == 2 * 7  # q k v o, w1 w2 w3
    # The embedding and the output head stay frozen: alone they learn this stream's bigrams, so
    # the loss falls only as far as the fp8 layers between them learn.
    blocks = [p for name, p in model.named_parameters() if name.startswith("layers.")]
    optimizer = torch.optim.AdamW(blocks, lr=3e-3)
    generator = torch.Generator().manual_seed(1)
    # A learnable stream: each token's successor is fixed, with a little noise.
    successor = torch.randperm(256, generator=generator)
    losses = []
    for _ in range(steps):
        start = torch.randint(0, 256, (8, 1), generator=generator)
        tokens = [start]
        for _ in range(32):
            tokens.append(successor[tokens[-1]])
        batch = torch.cat(tokens, dim=1)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_a_tiny_llama_trains_to_the_same_loss_in_fp8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_in_fp32)
    full, fp8 = _train(False, 60), _train(True, 60)
    mean_full, mean_fp8 = sum(full[-10:]) / 10, sum(fp8[-10:]) / 10
    assert mean_fp8 < 0.8 * fp8[0], fp8
    assert abs(mean_fp8 - mean_full) / mean_full < 0.05, (mean_full, mean_fp8)


def test_fp8_is_refused_without_fp8_tensor_cores() -> None:
    model = nn.Sequential(nn.Linear(32, 32))
    config = {
        "train": {"device": "cpu"},
        "parallel": {"transforms": {"precision": "amp"}},
        "amp": {"fp8": True},
        "telemetry": {"enabled": False},
    }
    with pytest.raises(ConfigError, match=r"amp\.fp8 needs a GPU .* this run is on cpu"):
        plait.initialize(model, config=config, loss_fn=lambda out, _: out.sum())


def test_fp8_needs_bf16_compute() -> None:
    from plait.plugins.precision import AmpConfig

    with pytest.raises(ValueError, match="fp8 runs over bf16"):
        AmpConfig(dtype="fp16", fp8=True)
