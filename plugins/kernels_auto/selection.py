"""Kernel providers chosen by measurement (`kernels.provider = "auto"`), cached per machine.

    selector = KernelSelector(plugins)  # real clocks, $PLAIT_CACHE_DIR/kernel-choices.json
    op = selector.measured("rms_norm", "cuda", "bfloat16", fallback=reference)
    y = op(x, weight, 1e-6)   # first call: every provider of rms_norm on cuda/bfloat16 is timed
    y = op(x, weight, 1e-6)   # later calls: the fastest, with no timing

The first call of an op decides, at that call's argument shapes and dtypes: every provider that
registers the op for the device type (`plait_register_kernels`) and answers `plait_kernel` for
the dtype runs once untimed on clones of the arguments (a warm-up that also compiles, and the
place a provider that cannot take the shape raises: it is skipped and the reason kept), then
the timer takes the median of a few repeats — forward, and forward + backward when an argument
requires grad. The fastest is used from then on, at every shape: one choice per op keeps the
per-call cost a single attribute read.

The choice lives in memory and in `$PLAIT_CACHE_DIR/kernel-choices.json`, beside the Triton
tiles, under a machine key (GPU model or CPU name, driver, torch, CUDA and triton versions):
a new driver or library misses the key and measures again; the same machine reuses the
choice without timing. Writes merge with what is on disk and replace the file whole, so ranks
of one host writing together lose at most an entry, never the file.

In-place ops (`adamw_step`) are not measured: timing them would update the real optimizer
state, or clone all of it. They stay on the configured preference order.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from plait.core.atomic_files import write_json_atomically
from plait.core.host import cache_dir, cpu_model
from plait.core.kernels import IN_PLACE_OPS

if TYPE_CHECKING:
    from plait.core.plugins import Plugins

CHOICES_FILE = "kernel-choices.json"
FORMAT_VERSION = 1

# Times one provider: (provider name, a run of the op on cloned inputs) -> seconds per run.
# Given the provider's name so that a test can rank providers without a clock.
Timer = Callable[[str, Callable[[], object]], float]


def _median_seconds(run: Callable[[], object], clock: Callable[[], float], sync: Callable[[], None],
                    *, warmup: int, repeats: int) -> float:  # fmt: skip
    for _ in range(warmup):
        run()
    sync()
    samples = []
    for _ in range(repeats):
        start = clock()
        run()
        sync()
        samples.append(clock() - start)
    return statistics.median(samples)


def cpu_timer(provider: str, run: Callable[[], object]) -> float:
    """Seconds per run on the host: `time.perf_counter`, the median of 5 after 2 warm-ups."""
    del provider
    return _median_seconds(run, time.perf_counter, lambda: None, warmup=2, repeats=5)


def cuda_timer(provider: str, run: Callable[[], object]) -> float:
    """Seconds per run on the GPU: CUDA events around each repeat, the median after warm-up."""
    del provider
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    samples = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000.0)  # elapsed_time is in milliseconds
    return statistics.median(samples)


def default_timer(device: str) -> Timer:
    return cuda_timer if device == "cuda" else cpu_timer


# --- what a choice is keyed by ---------------------------------------------------------------


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "absent"


def _driver_version() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            driver = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return driver.decode() if isinstance(driver, bytes) else str(driver)
    except Exception:  # no NVML on this host: the CUDA runtime version still changes the key
        return "unknown"


def machine_key(device: str) -> str:
    """The hardware and software a measurement holds for; any change measures again."""
    versions = f"torch {torch.__version__} | triton {_version('triton')}"
    if device == "cuda":
        return (
            f"{torch.cuda.get_device_name()} | driver {_driver_version()} | "
            f"cuda {torch.version.cuda} | {versions}"
        )
    return f"{cpu_model()} | {device} | {versions}"


def _describe(value: Any, depth: int = 0) -> str:
    if isinstance(value, torch.Tensor):
        grad = "+grad" if value.requires_grad else ""
        return f"{_dtype_name(value.dtype)}[{','.join(str(s) for s in value.shape)}]{grad}"
    if isinstance(value, (list, tuple)):
        items = [_describe(v, depth + 1) for v in value[:4]]
        more = f",…{len(value)}" if len(value) > 4 else ""
        return f"({','.join(items)}{more})"
    if value is None or isinstance(value, (bool, int, str)):
        return repr(value)  # flags (causal) and small integers (ignore_index) change the work
    return type(value).__name__  # a float (eps, lr) does not


def shape_signature(args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
    """The argument shapes, dtypes and flags of one call, as a key: `f32[4,128]+grad,…`."""
    parts = [_describe(a) for a in args]
    parts += [f"{name}={_describe(v)}" for name, v in sorted(kwargs.items())]
    return ", ".join(parts)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --- the record and the file -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Choice:
    """One measured decision: the provider used and what the others measured or raised."""

    op: str
    device: str
    dtype: str
    shapes: str
    provider: str
    timings: dict[str, float] = field(default_factory=dict)  # provider -> seconds per run
    skipped: dict[str, str] = field(default_factory=dict)  # provider -> why it was not timed
    timed: str = "forward"  # or "forward+backward"

    @property
    def key(self) -> str:
        return f"{self.op}|{self.device}|{self.dtype}|{self.shapes}"

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "device": self.device, "dtype": self.dtype, "shapes": self.shapes,
                "provider": self.provider, "timings": self.timings, "skipped": self.skipped,
                "timed": self.timed}  # fmt: skip

    @classmethod
    def from_json(cls, data: Any) -> Choice:
        return cls(
            op=str(data["op"]), device=str(data["device"]), dtype=str(data["dtype"]),
            shapes=str(data["shapes"]), provider=str(data["provider"]),
            timings={str(k): float(v) for k, v in dict(data.get("timings", {})).items()},
            skipped={str(k): str(v) for k, v in dict(data.get("skipped", {})).items()},
            timed=str(data.get("timed", "forward")),
        )  # fmt: skip


class ChoiceStore:
    """`{"format": 1, "machines": {machine key: {choice key: choice}}}` on disk."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()

    def get(self, machine: str, key: str) -> Choice | None:
        with self._lock:
            data = self.read().get(machine, {}).get(key)
        if data is None:
            return None
        try:
            return Choice.from_json(data)
        except (KeyError, TypeError, ValueError):
            return None  # an entry of another shape is measured again and replaced

    def put(self, machine: str, choice: Choice) -> None:
        with self._lock:
            machines = self.read()  # what other ranks wrote since
            machines.setdefault(machine, {})[choice.key] = choice.to_json()
            document = {"format": FORMAT_VERSION, "machines": machines}
            try:
                write_json_atomically(self.path, document)
            except OSError as exc:
                warnings.warn(
                    f"could not save the measured kernel choices to {self.path}: {exc}; they "
                    "hold for this process only",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def read(self) -> dict[str, dict[str, Any]]:
        """Machine key -> choice key -> choice as JSON; {} when absent or unreadable."""
        try:
            document = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"ignoring the measured kernel choices in {self.path} ({exc}); kernels are "
                "measured again and the file rewritten",
                RuntimeWarning,
                stacklevel=3,
            )
            return {}
        if not isinstance(document, dict) or document.get("format") != FORMAT_VERSION:
            return {}
        machines = document.get("machines")
        if not isinstance(machines, dict):
            return {}
        return {str(m): dict(c) for m, c in machines.items() if isinstance(c, dict)}

    def choices(self) -> dict[str, list[Choice]]:
        """Machine key -> its readable choices, for `plait kernels`."""
        listed: dict[str, list[Choice]] = {}
        for machine, entries in self.read().items():
            for data in entries.values():
                try:
                    listed.setdefault(machine, []).append(Choice.from_json(data))
                except (KeyError, TypeError, ValueError):
                    continue
        return listed


def default_store() -> ChoiceStore:
    return ChoiceStore(cache_dir() / CHOICES_FILE)


# --- measuring ------------------------------------------------------------------------------


def _clone(value: Any) -> Any:
    """A fresh copy of the arguments: providers never touch (or accumulate into) the real ones."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        return copy.requires_grad_(value.requires_grad)
    if isinstance(value, list):
        return [_clone(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_clone(v) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _run_once(impl: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              with_backward: bool) -> Callable[[], object]:  # fmt: skip
    leaves = [t for t in _tensors((args, tuple(kwargs.values()))) if t.requires_grad]

    def run() -> object:
        out = impl(*args, **kwargs)
        if not with_backward:
            return out
        outputs = [t for t in _tensors(out) if t.requires_grad]
        # autograd.grad, not backward: repeats do not accumulate into the clones' .grad.
        return torch.autograd.grad(
            outputs, leaves, [torch.ones_like(t) for t in outputs], allow_unused=True
        )

    return run


class KernelSelector:
    """Chooses, per op, device, dtype and first-call shapes, the fastest registered provider."""

    def __init__(
        self,
        plugins: Plugins,
        *,
        timer: Timer | None = None,
        store: ChoiceStore | None = None,
        machine: Callable[[str], str] = machine_key,
    ) -> None:
        self.plugins = plugins
        self.timer = timer
        self.store = store
        self.machine = machine
        self._memory: dict[tuple[str, str], Choice] = {}

    def measured(
        self, op: str, device: str, dtype: str, *, fallback: Callable[[], Callable[..., Any]]
    ) -> MeasuredOp:
        """`op` on `device` / `dtype`, its provider chosen at its first call (the facade's
        `KernelChooser` seam)."""
        if op in IN_PLACE_OPS:
            raise ValueError(f"{op!r} updates its arguments in place and is never measured")
        return MeasuredOp(self, op, device, dtype, fallback=fallback)

    def candidates(self, op: str, device: str) -> list[str]:
        """Providers that register `op` for `device`, in a stable order."""
        records = self.plugins.kernel_records()
        return sorted({r.provider for _, r in records if r.op == op and device in r.device_types})

    def choose(
        self, op: str, device: str, dtype: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Choice, Callable[..., Any]]:
        """The choice at these arguments (from memory, the file, or measured now) and its
        implementation. Raises `LookupError` if no provider could run the op here."""
        shapes = shape_signature(args, kwargs)
        machine = self.machine(device)
        key = (machine, f"{op}|{device}|{dtype}|{shapes}")
        store = self.store or default_store()
        choice = self._memory.get(key) or store.get(machine, key[1])
        impl = None if choice is None else self._impl(op, device, dtype, choice.provider)
        if choice is None or impl is None:  # unknown here, or its provider is gone
            choice, impl = self._measure(op, device, dtype, shapes, args, kwargs)
            store.put(machine, choice)
        self._memory[key] = choice
        return choice, impl

    def _impl(self, op: str, device: str, dtype: str, provider: str) -> Callable[..., Any] | None:
        return self.plugins.kernel(name=op, device=device, dtype=dtype, provider=provider)

    def _measure(
        self, op: str, device: str, dtype: str, shapes: str,
        args: tuple[Any, ...], kwargs: dict[str, Any],
    ) -> tuple[Choice, Callable[..., Any]]:  # fmt: skip
        timer = self.timer or default_timer(device)
        with_backward = any(t.requires_grad for t in _tensors((args, tuple(kwargs.values()))))
        timings: dict[str, float] = {}
        skipped: dict[str, str] = {}
        impls: dict[str, Callable[..., Any]] = {}
        for provider in self.candidates(op, device):
            impl = self._impl(op, device, dtype, provider)
            if impl is None:
                skipped[provider] = f"does not answer for {device}/{dtype}"
                continue
            run = _run_once(impl, _clone(args), _clone(kwargs), with_backward)
            try:
                run()  # untimed: compiles, and shows whether the provider takes this shape
                timings[provider] = float(timer(provider, run))
            except Exception as exc:  # any failure of a candidate only rules it out
                skipped[provider] = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                continue
            impls[provider] = impl
        if not timings:
            raise LookupError(
                f"no provider of kernel {op!r} runs on {device}/{dtype} at {shapes}: "
                + "; ".join(f"{p}: {why}" for p, why in skipped.items())
            )
        fastest = min(timings, key=timings.__getitem__)
        timed = "forward+backward" if with_backward else "forward"
        choice = Choice(op, device, dtype, shapes, fastest, timings, skipped, timed)
        return choice, impls[fastest]


class MeasuredOp:
    """An op whose provider is chosen by `KernelSelector` at its first call."""

    def __init__(
        self,
        selector: KernelSelector,
        op: str,
        device: str,
        dtype: str,
        *,
        fallback: Callable[[], Callable[..., Any]],
    ) -> None:
        self.selector = selector
        self.op, self.device, self.dtype = op, device, dtype
        self.fallback = fallback  # the preference order's answer, for calls that cannot measure
        self.choice: Choice | None = None
        self._impl: Callable[..., Any] | None = None
        self._lock = threading.Lock()

    @property
    def plait_provider(self) -> str:
        return self.choice.provider if self.choice is not None else "auto"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        impl = self._impl
        if impl is None:
            impl = self._decide(args, kwargs)
        return impl(*args, **kwargs)

    def _decide(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[..., Any]:
        if not self._measurable(args, kwargs):
            # Traced by torch.compile (fake tensors) or off the device: nothing real to time;
            # decide at the next real call.
            return self.fallback()
        with self._lock:
            if self._impl is None:
                try:
                    self.choice, self._impl = self.selector.choose(
                        self.op, self.device, self.dtype, args, kwargs
                    )
                except LookupError:
                    # Every provider raised here, the reference included: let the call raise
                    # its own error rather than one about measuring.
                    return self.fallback()
            return self._impl

    def _measurable(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        if torch.compiler.is_compiling():
            return False
        tensors = _tensors((args, tuple(kwargs.values())))
        return bool(tensors) and all(t.device.type == self.device for t in tensors)
