"""The kernel facade: models and strategies fetch ops by name, never a hard-wired implementation.

`Kernels.get(name, device, dtype)` asks `plait_kernel` once per (op, device type, dtype) and
caches the callable. Preference (`kernels.prefer = ["triton", "torch"]`) and per-op overrides
(`kernels.overrides = {attention = "torch"}`) choose between providers; the torch reference
plugin answers `trylast` for everything. With `kernels.provider = "auto"` (the default on CUDA
when `prefer` is empty) an op without an override is chosen by measurement at its first call
instead, by the `KernelChooser` a plugin answers `plait_kernel_chooser` with (the built-in
`plait.plugins.kernels_auto`); overrides and a `prefer` list win over it.

Op signatures every provider implements (all autograd-correct):

- `rms_norm(x, weight, eps) -> y`
- `layer_norm(x, weight, bias, eps) -> y`
- `swiglu(gate, up) -> silu(gate) * up`
- `bias_gelu(x, bias) -> gelu_tanh(x + bias)`
- `rope(x, cos, sin) -> y`: x is (batch, seq, heads, head_dim); cos/sin are (seq, head_dim // 2);
  rotation of the two halves of head_dim (the "rotate_half" convention)
- `softmax_cross_entropy(logits, targets, ignore_index=-100) -> mean loss` (logits (N, V))
- `attention(q, k, v, causal=True, *, return_lse=False) -> out`: q is (batch, heads, seq,
  head_dim); k, v are (batch, kv_heads, seq, head_dim) with heads % kv_heads == 0
  (grouped-query attention); `return_lse=True` returns `(out, lse)` with lse (batch, heads,
  seq) the float32 natural log-sum-exp of each query row's scaled scores, differentiable
  (context parallelism merges key/value blocks with it)
- `adamw_step(params, grads, exp_avgs, exp_avg_sqs, *, step, lr, beta1, beta2, eps,
  weight_decay) -> None`, updating the lists of tensors in place
- `grouped_mm(x, weight, counts) -> y`: x (N, K) is row groups of sizes `counts` (G,), in order;
  weight (G, M, K); group g's rows of y (N, M) are `x_g @ weight[g].T` (mixture-of-experts)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from plait.core.errors import PluginError

if TYPE_CHECKING:
    from plait.core.plugins import Plugins

KERNEL_OPS: tuple[str, ...] = (
    "rms_norm",
    "layer_norm",
    "swiglu",
    "bias_gelu",
    "rope",
    "softmax_cross_entropy",
    "attention",
    "adamw_step",
    "grouped_mm",
)
# Ops that update their arguments in place: never chosen by measurement (timing them would
# update the real optimizer state, or clone all of it); they stay on the preference order.
IN_PLACE_OPS: frozenset[str] = frozenset({"adamw_step"})


class KernelChooser(Protocol):
    """Chooses an op's provider by measurement (`plait_kernel_chooser`)."""

    def measured(
        self, op: str, device: str, dtype: str, *, fallback: Callable[[], Callable[..., Any]]
    ) -> Callable[..., Any]:
        """`op` on a device type and dtype, its provider chosen when it is first called. The
        callable's `plait_provider` names the choice ("auto" until then); `fallback()` is the
        preference order's answer, for a call that cannot be measured (traced, off device)."""
        ...


def _device_type(device: torch.device | str) -> str:
    return torch.device(device).type


def _dtype_name(dtype: torch.dtype | str) -> str:
    return dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")


class Kernels:
    """Resolves and caches kernel implementations through `plait_kernel`."""

    def __init__(
        self,
        plugins: Plugins,
        *,
        prefer: Sequence[str] = (),
        overrides: Mapping[str, str] | None = None,
        provider: str | None = None,
        selector: KernelChooser | None = None,
    ) -> None:
        self.plugins = plugins
        self.prefer = tuple(prefer)
        self.overrides = dict(overrides or {})
        # "auto": measure on every device; "prefer": never; None: measure on CUDA only, and
        # only when no preference order is given (a `prefer` list is an explicit choice).
        self.provider = provider
        # Asked of the plugins at the first op that measures (`chooser`), unless given.
        self.selector = selector
        self._asked_for_chooser = selector is not None
        self._measured: dict[tuple[str, str, str], Callable[..., Any]] = {}
        self._cache: dict[tuple[str, str, str], Callable[..., Any]] = {}
        self._by_given: dict[tuple[Any, Any, Any], Callable[..., Any]] = {}
        self._chosen: dict[tuple[str, str, str], str] = {}

    def get(
        self, name: str, device: torch.device | str, dtype: torch.dtype | str
    ) -> Callable[..., Any]:
        # Models ask on every call: a hit keyed by the objects as given skips building a
        # `torch.device` and a dtype name (2.2 µs per call instead of 0.2).
        impl = self._by_given.get((name, device, dtype))
        if impl is not None:
            return impl
        key = (name, _device_type(device), _dtype_name(dtype))
        if key not in self._cache:
            self._cache[key], self._chosen[key] = self._resolve(*key)
        self._by_given[(name, device, dtype)] = self._cache[key]
        return self._cache[key]

    def provider_of(self, name: str, device: torch.device | str, dtype: torch.dtype | str) -> str:
        """Which provider answered (after `get`), for `plait kernels` and logs."""
        key = (name, _device_type(device), _dtype_name(dtype))
        self.get(name, device, dtype)
        return self.chosen_providers()[key]

    def measures(self, name: str, device: str) -> bool:
        """Whether `name` on `device` is chosen by measurement rather than by preference."""
        if name in self.overrides or name in IN_PLACE_OPS:
            return False
        if self.provider is None:
            return device == "cuda" and not self.prefer
        return self.provider == "auto"

    def chooser(self) -> KernelChooser | None:
        """The plugins' `KernelChooser`, asked once; None when no plugin measures."""
        if not self._asked_for_chooser:
            self.selector = self.plugins.kernel_chooser()
            self._asked_for_chooser = True
        return self.selector

    def _resolve(self, name: str, device: str, dtype: str) -> tuple[Callable[..., Any], str]:
        chooser = self.chooser() if self.measures(name, device) else None
        if chooser is not None:
            measured = chooser.measured(
                name, device, dtype, fallback=lambda: self._preferred(name, device, dtype)[0]
            )
            self._measured[(name, device, dtype)] = measured
            return measured, "auto"
        if self.measures(name, device) and self.provider == "auto":
            raise PluginError(
                f"kernels.provider = 'auto' chooses op {name!r} by measurement, but no plugin "
                "answers plait_kernel_chooser (is the built-in 'kernels_auto' disabled?); "
                "set kernels.provider = 'prefer' or enable it"
            )
        return self._preferred(name, device, dtype)

    def _preferred(self, name: str, device: str, dtype: str) -> tuple[Callable[..., Any], str]:
        if name in self.overrides:
            forced = self.overrides[name]
            impl = self.plugins.kernel(name=name, device=device, dtype=dtype, provider=forced)
            if impl is None:
                raise PluginError(
                    f"kernels.overrides asks provider {forced!r} for op {name!r} on {device}/"
                    f"{dtype}, but it does not answer; providers of {name!r}: "
                    f"{self.providers_for(name)}"
                )
            return impl, forced
        for provider in self.prefer:
            impl = self.plugins.kernel(name=name, device=device, dtype=dtype, provider=provider)
            if impl is not None:
                return impl, provider
        impl = self.plugins.kernel(name=name, device=device, dtype=dtype, provider=None)
        if impl is None:
            raise PluginError(
                f"no installed plugin provides kernel {name!r} for {device}/{dtype}; "
                f"providers of {name!r}: {self.providers_for(name)}"
            )
        return impl, getattr(impl, "plait_provider", "unknown")

    def chosen_providers(self) -> dict[tuple[str, str, str], str]:
        """(op, device type, dtype) -> the provider that answered, for every op resolved
        ("auto" for a measured op not called yet)."""
        chosen = dict(self._chosen)
        for key, measured in self._measured.items():
            chosen[key] = getattr(measured, "plait_provider", "auto")
        return chosen

    def providers_for(self, name: str) -> list[str]:
        return sorted(
            {
                f"{r.provider} ({', '.join(r.device_types)})"
                for _, r in self.plugins.kernel_records()
                if r.op == name
            }
        )
