"""The `compiled` provider (`torch.compile` of each reference op): never a default, answers
when named, computes the reference forward and backward, and `auto` keeps it where it is the
fastest — so plait on an op is never slower than the compiler, by choice."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.plugins.kernels_auto.selection import ChoiceStore, KernelSelector
from plait.plugins.kernels_torch import ops
from plait.plugins.kernels_torch.compiled import COMPILED_OPS, PROVIDER

OP = "rms_norm"
BUILTINS = (("kernels_torch", "plait.plugins.kernels_torch"),)


def _plugins() -> Plugins:
    return Plugins.create(autoload=False, builtins=BUILTINS)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 32, generator=generator, requires_grad=True)
    weight = torch.randn(32, generator=generator, requires_grad=True)
    return x, weight


def _forward_backward(op: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
    x, weight = _inputs()
    y = op(x, weight, 1e-6)
    y.pow(2).sum().backward()
    assert x.grad is not None and weight.grad is not None
    return [y.detach(), x.grad, weight.grad]


def test_never_a_default_and_not_offered_for_in_place_or_data_shaped_ops() -> None:
    plugins = _plugins()
    for op in COMPILED_OPS:
        default = plugins.kernel(name=op, device="cpu", dtype="float32", provider=None)
        assert default is ops.OPS[op]
        assert Kernels(plugins).provider_of(op, "cpu", torch.float32) == "torch"
    for op in ("adamw_step", "grouped_mm"):
        assert plugins.kernel(name=op, device="cpu", dtype="float32", provider=PROVIDER) is None
    assert plugins.kernel(name=OP, device="cpu", dtype="int64", provider=PROVIDER) is None
    # The built-in set carries it: `plait kernels` and `auto` see it without configuration.
    assert "compiled (cpu, cuda)" in Kernels(Plugins.create(autoload=False)).providers_for(OP)


class _Timer:
    """Says the compiled provider is the fastest; runs each candidate once, as timing does."""

    def __init__(self) -> None:
        self.timed: list[str] = []

    def __call__(self, provider: str, run: Callable[[], object]) -> float:
        self.timed.append(provider)
        run()
        return {"torch": 2e-5, PROVIDER: 1e-5}[provider]


def test_named_it_compiles_the_reference_and_auto_keeps_it_where_fastest(tmp_path: Path) -> None:
    plugins = _plugins()
    named = Kernels(plugins, overrides={OP: PROVIDER})
    assert named.provider_of(OP, "cpu", torch.float32) == PROVIDER
    compiled = named.get(OP, "cpu", torch.float32)
    reference = _forward_backward(ops.rms_norm)
    graphs = counters["stats"]["unique_graphs"]
    for got, want in zip(_forward_backward(compiled), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # The reference under the compiler (Dynamo captured a graph), not the eager function.
    assert counters["stats"]["unique_graphs"] > graphs

    timer = _Timer()
    store = ChoiceStore(tmp_path / "kernel-choices.json")
    selector = KernelSelector(plugins, timer=timer, store=store, machine=lambda d: "test")
    measured = Kernels(plugins, provider="auto", selector=selector)
    chosen = measured.get(OP, "cpu", torch.float32)
    for got, want in zip(_forward_backward(chosen), reference, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert sorted(timer.timed) == [PROVIDER, "torch"]
    assert measured.provider_of(OP, "cpu", torch.float32) == PROVIDER
    (choice,) = store.choices()["test"]
    assert choice.provider == PROVIDER and choice.timed == "forward+backward"
