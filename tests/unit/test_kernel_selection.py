"""Kernels chosen by measurement (`kernels.provider = "auto"`): the fastest provider wins, the
choice is cached on disk per machine and versions, a provider that fails at a shape is skipped
with its reason, overrides win over measuring. Timers here are fakes reporting the times a test
chooses, so no assertion depends on a real clock."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.core.config import load_config
from plait.core.errors import ConfigError, PluginError
from plait.core.hookspecs import hookimpl
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins
from plait.core.records import KernelRecord
from plait.plugins.kernels_auto.selection import (
    ChoiceStore,
    KernelSelector,
    _median_seconds,
    machine_key,
    shape_signature,
)
from plait.plugins.kernels_torch import ops

OP = "rms_norm"


class FakeProvider:
    """Registers rms_norm and swiglu on CPU and CUDA; answers with the reference (counting its
    calls), or raises at every call when `fails_with` is given."""

    def __init__(self, name: str, fails_with: str = "") -> None:
        self.name = name
        self.fails_with = fails_with
        self.calls = 0
        self.seen: list[int] = []  # data pointer of each call's first argument

    @hookimpl
    def plait_register_kernels(self) -> Sequence[KernelRecord]:
        return [
            KernelRecord(op=op, provider=self.name, device_types=("cpu", "cuda"))
            for op in (OP, "swiglu")
        ]

    @hookimpl
    def plait_kernel(self, name: str, device: str, dtype: str, provider: str | None) -> Any:
        if provider != self.name or name not in (OP, "swiglu"):
            return None
        reference = ops.OPS[name]

        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            self.seen.append(args[0].data_ptr())
            if self.fails_with:
                raise ValueError(self.fails_with)
            return reference(*args, **kwargs)

        run.plait_provider = self.name  # type: ignore[attr-defined]
        return run


class FakeTimer:
    """Reports `seconds[provider]` and records who was timed; runs each candidate once, so a
    candidate that raises inside the timer is exercised too."""

    def __init__(self, seconds: dict[str, float]) -> None:
        self.seconds = seconds
        self.timed: list[str] = []
        self.results: dict[str, object] = {}  # what one timed run returned, per provider

    def __call__(self, provider: str, run: Callable[[], object]) -> float:
        self.timed.append(provider)
        self.results[provider] = run()
        return self.seconds[provider]


class TorchReference:
    """The torch reference provider alone (the built-in plugin also serves "compiled", whose
    first call compiles: `tests/unit/test_kernels_compiled.py` measures that one)."""

    @hookimpl
    def plait_register_kernels(self) -> Sequence[KernelRecord]:
        return [
            KernelRecord(op=op, provider=ops.PROVIDER, device_types=("cpu", "cuda"))
            for op in ops.OPS
        ]

    @hookimpl(trylast=True)
    def plait_kernel(self, name: str, device: str, dtype: str, provider: str | None) -> Any:
        return ops.OPS.get(name) if provider in (None, ops.PROVIDER) else None


def _plugins(*providers: FakeProvider) -> Plugins:
    # A fresh manager with the torch reference and the fakes only (no Triton interpreter).
    return Plugins.create(
        autoload=False,
        builtins=(),
        extra=[("torch_reference", TorchReference()), *((p.name, p) for p in providers)],
    )


def _kernels(
    plugins: Plugins,
    timer: FakeTimer,
    store: ChoiceStore,
    *,
    machine: Callable[[str], str] = lambda device: f"test machine ({device})",
    **options: Any,
) -> Kernels:
    selector = KernelSelector(plugins, timer=timer, store=store, machine=machine)
    return Kernels(plugins, provider=options.pop("provider", "auto"), selector=selector, **options)


def _inputs(grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, 16, generator=generator).requires_grad_(grad)
    weight = torch.randn(16, generator=generator).requires_grad_(grad)
    return x, weight


@pytest.fixture
def store(tmp_path: Path) -> ChoiceStore:
    return ChoiceStore(tmp_path / "kernel-choices.json")


def test_the_fastest_provider_is_chosen_and_computes_the_reference(store: ChoiceStore) -> None:
    fast, slow = FakeProvider("fast"), FakeProvider("slow")
    timer = FakeTimer({"torch": 3e-5, "fast": 1e-5, "slow": 9e-5})
    kernels = _kernels(_plugins(fast, slow), timer, store)
    assert kernels.provider_of(OP, "cpu", torch.float32) == "auto"  # not called yet
    x, weight = _inputs()
    y = kernels.get(OP, "cpu", torch.float32)(x, weight, 1e-6)
    assert sorted(timer.timed) == ["fast", "slow", "torch"]
    assert kernels.provider_of(OP, "cpu", torch.float32) == "fast"
    assert kernels.chosen_providers()[(OP, "cpu", "float32")] == "fast"
    torch.testing.assert_close(y, ops.rms_norm(x, weight, 1e-6), rtol=0, atol=0)
    calls = fast.calls
    kernels.get(OP, "cpu", torch.float32)(x, weight, 1e-6)
    assert fast.calls == calls + 1 and len(timer.timed) == 3  # later calls: no timing
    # Timing ran on clones: the real input reached the providers only in the two real calls.
    assert fast.seen.count(x.data_ptr()) == 2 and slow.seen.count(x.data_ptr()) == 0
    (saved,) = store.choices()["test machine (cpu)"]
    assert saved.provider == "fast" and saved.timed == "forward"
    assert saved.timings == {"torch": 3e-5, "fast": 1e-5, "slow": 9e-5}
    assert saved.shapes == "float32[4,8,16], float32[16], float"


def test_with_grad_forward_and_backward_are_timed_on_clones(store: ChoiceStore) -> None:
    timer = FakeTimer({"torch": 2.0, "fast": 1.0})
    kernels = _kernels(_plugins(FakeProvider("fast")), timer, store)
    x, weight = _inputs(grad=True)
    y = kernels.get(OP, "cpu", torch.float32)(x, weight, 1e-6)
    # The timed run went through backward (it returns the inputs' gradients), on clones: the
    # real leaves have no gradient yet.
    grad_x, grad_w = timer.results["fast"]  # type: ignore[misc]
    assert grad_x.shape == x.shape and grad_w.shape == weight.shape
    assert x.grad is None and weight.grad is None
    y.sum().backward()
    expected_x, expected_w = (t.detach().clone().requires_grad_() for t in _inputs())
    ops.rms_norm(expected_x, expected_w, 1e-6).sum().backward()
    torch.testing.assert_close(x.grad, expected_x.grad)
    (saved,) = store.choices()["test machine (cpu)"]
    assert saved.timed == "forward+backward" and "+grad" in saved.shapes


def test_a_later_run_reuses_the_file_and_new_versions_measure_again(
    store: ChoiceStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    plugins = _plugins(FakeProvider("fast"), FakeProvider("slow"))
    first = FakeTimer({"torch": 3.0, "fast": 1.0, "slow": 2.0})
    x, weight = _inputs()
    _kernels(plugins, first, store, machine=machine_key).get(OP, "cpu", "float32")(x, weight, 1e-6)
    assert len(first.timed) == 3

    # A new process (fresh facade, selector and timer) on the same machine: read, not timed.
    again = FakeTimer({"torch": 1.0, "fast": 3.0, "slow": 2.0})
    kernels = _kernels(plugins, again, store, machine=machine_key)
    kernels.get(OP, "cpu", "float32")(x, weight, 1e-6)
    assert again.timed == []
    assert kernels.provider_of(OP, "cpu", "float32") == "fast"

    # Another torch (or triton, or driver) misses the key: measured again, under a new key.
    monkeypatch.setattr(torch, "__version__", "99.0.0")
    assert "torch 99.0.0" in machine_key("cpu") and "triton " in machine_key("cpu")
    upgraded = FakeTimer({"torch": 1.0, "fast": 3.0, "slow": 2.0})
    kernels = _kernels(plugins, upgraded, store, machine=machine_key)
    kernels.get(OP, "cpu", "float32")(x, weight, 1e-6)
    assert sorted(upgraded.timed) == ["fast", "slow", "torch"]
    assert kernels.provider_of(OP, "cpu", "float32") == "torch"
    assert len(store.choices()) == 2  # both machine keys kept


def test_other_shapes_are_keyed_apart() -> None:
    x, weight = _inputs()
    assert shape_signature((x, weight, 1e-6), {}) != shape_signature((x[:2], weight, 1e-6), {})
    assert shape_signature((x,), {"causal": True}) != shape_signature((x,), {"causal": False})
    assert shape_signature((x, weight, 1e-6), {}) == shape_signature((x, weight, 1e-5), {})


def test_a_provider_that_fails_at_the_shape_is_skipped_and_listed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from typer.testing import CliRunner

    from plait.tools.kernels_commands import app

    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    broken = FakeProvider("broken", fails_with="BLOCK_N 128 exceeds the row of 16")
    timer = FakeTimer({"torch": 3.0, "fast": 2.0, "broken": 0.1})
    store = ChoiceStore(tmp_path / "kernel-choices.json")
    kernels = _kernels(_plugins(FakeProvider("fast"), broken), timer, store)
    x, weight = _inputs()
    y = kernels.get(OP, "cpu", "float32")(x, weight, 1e-6)
    torch.testing.assert_close(y, ops.rms_norm(x, weight, 1e-6))
    assert kernels.provider_of(OP, "cpu", "float32") == "fast"
    (saved,) = store.choices()["test machine (cpu)"]
    assert saved.skipped == {"broken": "ValueError: BLOCK_N 128 exceeds the row of 16"}
    assert "broken" not in saved.timings

    result = CliRunner().invoke(app, [], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "measured kernel choices: test machine (cpu)" in result.output
    row = next(line for line in result.output.splitlines() if "BLOCK_N 128" in line)
    assert "rms_norm" in row and "fast" in row and "broken: ValueError" in row


def test_overrides_and_prefer_win_over_measuring(store: ChoiceStore) -> None:
    plugins = _plugins(FakeProvider("fast"), FakeProvider("slow"))
    timer = FakeTimer({"torch": 3.0, "fast": 1.0, "slow": 9.0})
    kernels = _kernels(plugins, timer, store, overrides={OP: "slow"})
    x, weight = _inputs()
    kernels.get(OP, "cpu", "float32")(x, weight, 1e-6)
    assert kernels.provider_of(OP, "cpu", "float32") == "slow"
    assert timer.timed == []
    assert kernels.measures("swiglu", "cpu")  # only the overridden op is left alone

    # Unset: measured on CUDA only, and not at all once a preference order is given; in-place
    # ops are never measured (they stay on the preference order).
    default = Kernels(plugins)
    assert default.measures(OP, "cuda") and not default.measures(OP, "cpu")
    assert not default.measures("adamw_step", "cuda")
    assert not Kernels(plugins, prefer=["fast"]).measures(OP, "cuda")
    assert not Kernels(plugins, provider="prefer").measures(OP, "cuda")
    assert Kernels(plugins, prefer=["fast"]).provider_of(OP, "cpu", "float32") == "fast"


def test_config_refuses_auto_together_with_a_preference_order() -> None:
    assert load_config(None, ["kernels.provider=auto"]).kernels.provider == "auto"
    assert load_config(None, []).kernels.provider is None
    with pytest.raises(ConfigError, match=r"kernels\.provider = 'auto'"):
        load_config(None, ["kernels.provider=auto", "kernels.prefer=['torch']"])


def test_the_timer_is_the_median_of_repeats_after_warm_up() -> None:
    ticks = iter([0.0, 1.0, 10.0, 13.0, 20.0, 22.0])  # runs of 1, 3 and 2 seconds
    runs: list[int] = []
    seconds = _median_seconds(
        lambda: runs.append(1), lambda: next(ticks), lambda: None, warmup=2, repeats=3
    )
    assert seconds == 2.0 and len(runs) == 5


def test_the_engine_passes_kernels_provider_to_the_facade() -> None:
    from plait.core.engine import Engine

    config = {
        "telemetry": {"enabled": False},
        "train": {"device": "cpu", "global_batch_size": 1},
        "kernels": {"provider": "auto"},
    }
    assert Engine(config=config).kernels.provider == "auto"


# -- the seam: the facade decides whether an op is measured, a plugin's chooser how ------------


class ChooserPlugin:
    """A third party's `plait_kernel_chooser`: the core's own `KernelSelector` with a fake
    timer and its own store, answering before the built-in one."""

    name = "my_chooser"

    def __init__(self, timer: FakeTimer, store: ChoiceStore) -> None:
        self.timer, self.store = timer, store

    @hookimpl
    def plait_kernel_chooser(self, plugins: Plugins) -> KernelSelector:
        return KernelSelector(plugins, timer=self.timer, store=self.store)


def test_the_built_in_chooser_is_asked_once_and_a_plugin_answers_before_it(
    store: ChoiceStore,
) -> None:
    built_in = Kernels(Plugins.create(autoload=False), provider="auto")
    assert built_in.chooser() is built_in.chooser()  # asked once per facade
    assert type(built_in.chooser()).__module__ == "plait.plugins.kernels_auto.selection"

    fast = FakeProvider("fast")
    timer = FakeTimer({"torch": 3e-5, "fast": 1e-5})
    plugins = _plugins(fast, ChooserPlugin(timer, store))  # type: ignore[arg-type]
    kernels = Kernels(plugins, provider="auto")
    x, weight = _inputs()
    kernels.get(OP, "cpu", torch.float32)(x, weight, 1e-6)
    assert sorted(timer.timed) == ["fast", "torch"]  # the plugin's timer measured
    assert kernels.provider_of(OP, "cpu", torch.float32) == "fast"
    # Saved in the plugin's store, under the real machine's key (its selector's default).
    assert [c.provider for c in store.choices()[machine_key("cpu")]] == ["fast"]


def test_without_a_chooser_auto_is_refused_by_name_and_the_default_prefers() -> None:
    plugins = _plugins(FakeProvider("fast"))  # no plugin answers plait_kernel_chooser
    with pytest.raises(PluginError, match=r"kernels\.provider = 'auto'.*kernels_auto"):
        Kernels(plugins, provider="auto").get(OP, "cpu", torch.float32)
    # Unset (measuring on CUDA by default): the preference order answers instead.
    default = Kernels(plugins)
    assert default.measures(OP, "cuda")
    assert default.provider_of(OP, "cuda", "float32") in {"fast", "torch"}
    assert default.chooser() is None


def test_in_place_ops_are_never_handed_to_the_chooser(store: ChoiceStore) -> None:
    selector = KernelSelector(_plugins(), timer=FakeTimer({}), store=store)
    with pytest.raises(ValueError, match="in place"):
        selector.measured("adamw_step", "cpu", "float32", fallback=lambda: ops.OPS["adamw_step"])
    kernels = Kernels(_plugins(), provider="auto", selector=selector)
    assert kernels.provider_of("adamw_step", "cpu", "float32") == "torch"
