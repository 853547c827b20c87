"""Kernel providers chosen by measurement: what `kernels.provider = "auto"` asks for.

The kernel facade (`plait.core.kernels.Kernels`) decides *whether* an op is chosen by
measurement (`auto`, or by default on CUDA when `kernels.prefer` is empty); this plugin decides
*how*: it answers `plait_kernel_chooser` with a `KernelSelector` (`selection.py`), which times
every registered provider of an op at its first call's shapes and keeps the fastest, cached per
machine in `$PLAIT_CACHE_DIR/kernel-choices.json`. `plait kernels` reads that file.

Answers `trylast`, so a plugin of its own (a different timer, a shared cache) answers first.
Blocked (`plugins.disable = ["kernels_auto"]`), nothing is measured: the default falls back to
the preference order, and an explicit `kernels.provider = "auto"` is refused by name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from plait.core.hookspecs import hookimpl
from plait.plugins.kernels_auto.selection import KernelSelector

if TYPE_CHECKING:
    from plait.core.plugins import Plugins

__all__ = ["KernelSelector", "plait_kernel_chooser"]


@hookimpl(trylast=True)
def plait_kernel_chooser(plugins: Plugins) -> KernelSelector:
    return KernelSelector(plugins)
