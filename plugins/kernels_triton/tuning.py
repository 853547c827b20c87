"""Tile configurations chosen by measurement, per GPU model: the Triton kernels' autotuner.

A tile that is fast on one GPU is not on another: the best query / key block sizes, warps per
program and pipeline depth of an attention kernel move with the shared memory, register file
and matrix units of the chip, and with the dtype and head size. So each tuned kernel names a
few candidate `Tile`s, and the first launch for a new problem (`TileTuner.choose`: its key is
the dtype and the shape classes that decide the best tile) times every candidate on the
device, keeps the fastest and writes it to `$PLAIT_CACHE_DIR/triton-tiles.json` under the
GPU's name, so the next run on the same GPU model starts tuned.

- Timing is `triton.testing.do_bench`: CUDA events, the median of repetitions after warm-up.
  A candidate the chip cannot run (too much shared memory, too many registers) is skipped.
- Every launch a candidate makes is a complete launch of the real kernel on the real inputs,
  so kernels are tuned only where that has no side effect: their outputs are written whole
  and nothing is accumulated or updated in place (attention, grouped GEMM).
- Ranks of one host tune independently and write the same file: each write merges what is on
  disk and replaces the file whole, so a race loses at most an entry (tuned again next run),
  never the file.
- Without tuning (the Triton interpreter, a CPU, or `PLAIT_TRITON_AUTOTUNE=0`) the kernel's
  default tile is used and nothing is timed. `tuning(bench=…)` overrides both for a block of
  code: the tests time candidates under the interpreter with a bench of their own.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import warnings
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from plait.core.atomic_files import write_json_atomically
from plait.core.host import cache_dir
from plait.plugins.kernels_triton.launch import interpreting

AUTOTUNE_ENV = "PLAIT_TRITON_AUTOTUNE"
TILES_FILE = "triton-tiles.json"

# Times a candidate: (the kernel's name, the tile, a launch with it) -> seconds or milliseconds,
# any unit, lower is faster. Given the name and tile so that a test can rank without a clock.
Bench = Callable[[str, "Tile", Callable[[], object]], float]


@dataclass(frozen=True, slots=True)
class Tile:
    """One launch configuration: the kernel's block sizes (its `tl.constexpr` parameters) and,
    compiled, the warps per program and the software-pipelining depth; `host` holds what the
    launcher itself reads and the kernel never sees (how many persistent programs per SM)."""

    blocks: tuple[tuple[str, int], ...]
    num_warps: int = 4
    num_stages: int = 2
    host: tuple[tuple[str, int], ...] = ()

    def __getitem__(self, name: str) -> int:
        return dict(self.blocks)[name]

    def host_setting(self, name: str, default: int) -> int:
        return dict(self.host).get(name, default)

    def launch_options(self) -> dict[str, int]:
        """Keyword arguments for the kernel launch. The interpreter takes no warps or stages."""
        options = dict(self.blocks)
        if not interpreting():
            options.update(num_warps=self.num_warps, num_stages=self.num_stages)
        return options

    def to_json(self) -> dict[str, Any]:
        data = {"blocks": dict(self.blocks), "num_warps": self.num_warps,
                "num_stages": self.num_stages}  # fmt: skip
        return data | ({"host": dict(self.host)} if self.host else {})

    @classmethod
    def from_json(cls, data: Any) -> Tile:
        host_data = data.get("host", {}) if isinstance(data, dict) else {}
        host = {str(name): int(value) for name, value in dict(host_data).items()}
        return tile(int(data["num_warps"]), int(data["num_stages"]), host=host, **{
            str(name): int(size) for name, size in dict(data["blocks"]).items()
        })  # fmt: skip

    def __str__(self) -> str:
        settings = [*self.blocks, ("warps", self.num_warps), ("stages", self.num_stages),
                    *self.host]  # fmt: skip
        return " ".join(f"{name}={value}" for name, value in settings)


def tile(
    num_warps: int, num_stages: int, *, host: dict[str, int] | None = None, **blocks: int
) -> Tile:
    return Tile(tuple(sorted(blocks.items())), num_warps, num_stages,
                tuple(sorted((host or {}).items())))  # fmt: skip


class TileStore:
    """The chosen tiles on disk: GPU name -> kernel -> problem key -> tile."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, dict[str, Any]]] | None = None

    def get(self, device: str, kernel: str, key: str) -> Any | None:
        with self._lock:
            if self._entries is None:
                self._entries = self._read()
            kernels = self._entries.get(device)
            problems = kernels.get(kernel) if isinstance(kernels, dict) else None
            return problems.get(key) if isinstance(problems, dict) else None

    def put(self, device: str, kernel: str, key: str, chosen: Tile) -> None:
        with self._lock:
            entries = self._read()  # what other processes wrote since
            kernels = entries.get(device)
            if not isinstance(kernels, dict):  # an entry of another shape is replaced
                kernels = entries[device] = {}
            problems = kernels.get(kernel)
            if not isinstance(problems, dict):
                problems = kernels[kernel] = {}
            problems[key] = chosen.to_json()
            self._entries = entries
            try:
                write_json_atomically(self.path, entries)
            except OSError as exc:
                warnings.warn(
                    f"could not save the tuned Triton tiles to {self.path}: {exc}; "
                    "they hold for this process only",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _read(self) -> dict[str, dict[str, dict[str, Any]]]:
        try:
            entries = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            warnings.warn(
                f"ignoring the tuned Triton tiles in {self.path} ({exc}); kernels are tuned "
                "again and the file rewritten",
                RuntimeWarning,
                stacklevel=4,
            )
            return {}
        if not isinstance(entries, dict):
            warnings.warn(
                f"ignoring the tuned Triton tiles in {self.path}: not a JSON object",
                RuntimeWarning,
                stacklevel=4,
            )
            return {}
        return entries


def default_store() -> TileStore:
    return TileStore(cache_dir() / TILES_FILE)


def cuda_bench(kernel: str, candidate: Tile, run: Callable[[], object]) -> float:
    """Milliseconds per launch of `run`: CUDA events, the median after warm-up."""
    import triton.testing

    return float(triton.testing.do_bench(run, warmup=10, rep=40, return_mode="median"))


@dataclass(slots=True)
class _Settings:
    bench: Bench | None = None  # None: `cuda_bench` on a GPU, no tuning elsewhere
    store: TileStore | None = None  # None: `default_store()`, made when first needed


_settings = _Settings()


@contextlib.contextmanager
def tuning(*, bench: Bench | None = None, store: TileStore | None = None) -> Iterator[None]:
    """Within the block, tune with `bench` (on any device, the interpreter included) and keep
    the choices in `store`; the tuners forget what they chose before and after."""
    previous = _Settings(_settings.bench, _settings.store)
    _settings.bench, _settings.store = bench, store
    TileTuner.forget_all()
    try:
        yield
    finally:
        _settings.bench, _settings.store = previous.bench, previous.store
        TileTuner.forget_all()


def _untunable_errors() -> tuple[type[BaseException], ...]:
    """What compiling or launching a tile too big for the chip raises (what Triton's own
    autotuner skips)."""
    from triton.compiler.errors import CompileTimeAssertionFailure
    from triton.runtime.errors import OutOfResources, PTXASError

    return OutOfResources, CompileTimeAssertionFailure, PTXASError


class TileTuner:
    """Chooses one kernel's tile per problem key, among its candidates, by timing them."""

    _instances: ClassVar[list[TileTuner]] = []

    def __init__(self, kernel: str, candidates: Sequence[Tile], *, default: Tile) -> None:
        if default not in candidates:
            raise ValueError(f"{kernel}: the default tile {default} is not a candidate")
        self.kernel = kernel
        self.candidates = tuple(candidates)
        self.default = default
        self._chosen: dict[tuple[str, tuple[Hashable, ...]], Tile] = {}
        self._lock = threading.Lock()
        TileTuner._instances.append(self)

    @classmethod
    def registered(cls) -> tuple[TileTuner, ...]:
        return tuple(cls._instances)

    @classmethod
    def named(cls, kernel: str) -> TileTuner:
        """The tuner of `kernel` (as its module registered it)."""
        for tuner in cls._instances:
            if tuner.kernel == kernel:
                return tuner
        raise KeyError(f"no tuned kernel named {kernel!r}")

    @classmethod
    def forget_all(cls) -> None:
        for tuner in cls._instances:
            with tuner._lock:
                tuner._chosen.clear()

    def chosen(self) -> dict[tuple[str, tuple[Hashable, ...]], Tile]:
        """What this process chose so far: (device, key) -> tile."""
        with self._lock:
            return dict(self._chosen)

    def choose(
        self,
        key: tuple[Hashable, ...],
        run: Callable[[Tile], object],
        device: torch.device,
        *,
        among: Sequence[Tile] | None = None,
        default: Tile | None = None,
    ) -> Tile:
        """The tile for problem `key` on `device`. `run(tile)` launches the kernel with it on
        the real inputs; it is called for every candidate the first time a key is seen.

        `among` and `default` narrow the candidates and move the default for this problem,
        where those depend on it (a row kernel's warps on the row's width); the key must then
        decide them, and each must be one of the tuner's candidates."""
        candidates = self.candidates if among is None else tuple(among)
        default = self.default if default is None else default
        bench = _settings.bench
        if bench is None:
            if device.type != "cuda" or interpreting() or os.environ.get(AUTOTUNE_ENV) == "0":
                return default
            bench = cuda_bench
        memo = (str(device), key)  # the device's name is read only when a key is new
        with self._lock:
            found = self._chosen.get(memo)
        if found is not None:
            return found
        if default not in candidates or not set(candidates) <= set(self.candidates):
            raise ValueError(
                f"{self.kernel}: {default} and {[str(c) for c in candidates]} must be among "
                "the tuner's candidates, the default among those chosen from"
            )
        device_name = _device_name(device)
        store = _settings.store or default_store()
        key_text = "|".join(str(part) for part in key)
        chosen = self._stored(store, device_name, key_text, candidates)
        if chosen is None:
            chosen = self._fastest(bench, run, candidates, default)
            store.put(device_name, self.kernel, key_text, chosen)
        with self._lock:
            self._chosen[memo] = chosen
        return chosen

    def _stored(
        self, store: TileStore, device_name: str, key: str, candidates: Sequence[Tile]
    ) -> Tile | None:
        data = store.get(device_name, self.kernel, key)
        if data is None:
            return None
        try:
            stored = Tile.from_json(data)
        except (KeyError, TypeError, ValueError):
            return None
        # A tile this version no longer offers is tuned again rather than trusted.
        return stored if stored in candidates else None

    def _fastest(
        self,
        bench: Bench,
        run: Callable[[Tile], object],
        candidates: Sequence[Tile],
        default: Tile,
    ) -> Tile:
        untunable = _untunable_errors()
        timings: dict[Tile, float] = {}
        for candidate in candidates:
            try:
                timings[candidate] = bench(
                    self.kernel, candidate, lambda candidate=candidate: run(candidate)
                )
            except untunable:
                continue
        if not timings:
            return default
        return min(timings, key=timings.__getitem__)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} (Triton interpreter)" if interpreting() else device.type


def power_of_two_class(n: int) -> int:
    """`n` rounded up to a power of two: problems in one class share a tuned tile."""
    return 1 << max(0, int(n) - 1).bit_length()
