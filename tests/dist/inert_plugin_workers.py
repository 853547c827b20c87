"""Third-party plugins that are selected and do nothing, and the rank function that runs them.

Each is written as a plugin author following an older README might have written it: it reads
its selection from `config.extensions` (where plait no longer puts it), so it never believes
it is selected and answers `None` to everything, while its registration hooks still offer the
name the config selects.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from plait.core.hookspecs import hookimpl
from plait.core.records import CommAlgorithmRecord, KernelRecord, ScheduleRecord

STEPS = 2


class StaleInt8:
    """A communication algorithm: int8 all-reduce, never switched on."""

    selected = False

    @hookimpl
    def plait_register_comm_algorithms(self) -> list[CommAlgorithmRecord]:
        return [CommAlgorithmRecord(name="int8_stale", ops=("all_reduce", "reduce_scatter"))]

    @hookimpl
    def plait_configure(self, config: Any) -> None:
        comm = (config.model_extra or {}).get("comm", {})  # the old place; empty now
        self.selected = comm.get("algorithm") == "int8_stale"

    @hookimpl
    def plait_communicate(self, request: Any) -> Any:
        return None  # `selected` is never true: every op goes to the default


class StaleKernels:
    """A CPU kernel provider whose fused RMSNorm waits for an option it never sees."""

    @hookimpl
    def plait_register_kernels(self) -> list[KernelRecord]:
        return [KernelRecord(op="rms_norm", provider="cpu_stale", device_types=("cpu",))]

    @hookimpl
    def plait_kernel(self, name: str, device: str, dtype: str, provider: str | None) -> Any:
        return None


class StaleSchedule:
    """A schedule that expects the micro-batch count under an older field name."""

    @hookimpl
    def plait_register_schedules(self) -> list[ScheduleRecord]:
        return [ScheduleRecord(name="reverse_stale")]

    @hookimpl
    def plait_schedule(self, request: Any) -> Any:
        if request.name != "reverse_stale" or not hasattr(request, "microbatches"):
            return None
        raise AssertionError("never reached")


def stale_plugins() -> list[tuple[str, object]]:
    return [("int8_stale", StaleInt8()), ("cpu_stale", StaleKernels()),
            ("reverse_stale", StaleSchedule())]  # fmt: skip


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def run_cases(rank: int, world_size: int, cases: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each case on the same ranks: "error" and the message, or "trained" and the steps
    done, with the warnings this rank logged."""
    del world_size
    from plait.core.engine import Engine
    from plait.core.errors import PluginError
    from plait.core.plugins import Plugins
    from plait.testing.distributed import merged_config

    results: dict[str, Any] = {}
    for name, overrides in cases.items():
        config = merged_config(overrides)
        captured = Captured()
        logging.getLogger("plait.plugins").addHandler(captured)
        engine = None
        try:
            engine = Engine(config=config, plugins=Plugins.create(extra=stale_plugins()))
            share = config["train"]["global_batch_size"] // engine.mesh.size("dp")
            tokens = torch.randint(0, 256, (share, config["data"]["seq_len"] + 1),
                                   generator=torch.Generator().manual_seed(rank))  # fmt: skip
            for _ in range(STEPS):
                engine.train_step((tokens[:, :-1], tokens[:, 1:]))
            outcome: tuple[str, Any] = ("trained", engine.global_step)
        except PluginError as exc:
            outcome = ("error", str(exc), engine.global_step if engine else -1)
        finally:
            logging.getLogger("plait.plugins").removeHandler(captured)
        results[name] = (*outcome, captured.messages)
    return results
