"""Optimizer-state offload: CPU memory (for GPU training) and NVMe / local files.

CPU offload needs no machinery here: the master shards and their optimizer state are simply
allocated on the CPU (pinned when CUDA is present) and the optimizer steps there, as in
ZeRO-Offload. File offload keeps each optimizer-state tensor in its own file between steps: after
a step its bytes are written out and its storage is released; before the next step they are read
back. Reads and writes run on a background thread pool (file I/O releases the GIL), so writes
overlap the next forward pass and reads overlap the backward pass that precedes the step.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from plait.core.errors import ConfigError

_instance_ids = itertools.count()


def check_writable(path: str) -> Path:
    """Create `path` if needed and prove a file can be written there; else a ConfigError."""
    if not path:
        raise ConfigError(
            "zero.offload.path: offload.device = 'nvme' needs a directory on a local drive "
            "(e.g. path = '/local_nvme/plait')"
        )
    directory = Path(path).expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".plait-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"zero.offload.path: cannot write to {str(directory)!r} ({exc.strerror or exc}); "
            "choose a writable directory"
        ) from None
    return directory


def _raw_bytes(tensor: torch.Tensor, nbytes: int) -> memoryview:
    # NOTE: not `tensor.numpy()`: that marks the storage non-resizable for good, and releasing
    # the memory between steps is the point of offloading.
    return memoryview((ctypes.c_char * nbytes).from_address(tensor.data_ptr())).cast("B")


def _write_then_release(tensor: torch.Tensor, nbytes: int, file: Path) -> None:
    with open(file, "wb") as f:
        f.write(_raw_bytes(tensor, nbytes))
    tensor.untyped_storage().resize_(0)


def _restore_then_read(tensor: torch.Tensor, nbytes: int, file: Path) -> None:
    tensor.untyped_storage().resize_(nbytes)
    with open(file, "rb") as f:
        read = f.readinto(_raw_bytes(tensor, nbytes))
    if read != nbytes:
        raise OSError(f"short read from {file}: {read} of {nbytes} bytes")


class FileOffload:
    """Keeps CPU tensors in files between uses; every transfer is asynchronous."""

    def __init__(self, path: str, *, rank: int, io_workers: int = 2) -> None:
        root = check_writable(path)
        self.directory = root / f"rank{rank}-pid{os.getpid()}-{next(_instance_ids)}"
        self.directory.mkdir(parents=True, exist_ok=False)
        self._pool = ThreadPoolExecutor(max_workers=io_workers, thread_name_prefix="plait-offload")
        # key -> (tensor, nbytes, file); a key's latest transfer must finish before the next one.
        self._entries: dict[str, tuple[torch.Tensor, int, Path]] = {}
        self._pending: dict[str, Future[None]] = {}
        self._resident: set[str] = set()
        self.bytes_written = 0
        self.bytes_read = 0
        self._finalizer = weakref.finalize(self, FileOffload._cleanup, self._pool, self.directory)

    @staticmethod
    def _cleanup(pool: ThreadPoolExecutor, directory: Path) -> None:
        pool.shutdown(wait=True)
        shutil.rmtree(directory, ignore_errors=True)

    def _after(self, key: str, fn: object, *args: object) -> None:
        previous = self._pending.get(key)

        def run() -> None:
            if previous is not None:
                previous.result()
            fn(*args)  # type: ignore[operator]

        self._pending[key] = self._pool.submit(run)

    def offload(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Start writing each (key, tensor) to its file; its storage is freed once written."""
        for key, tensor in tensors:
            known = self._entries.get(key)
            if known is not None and known[0] is tensor:
                if key not in self._resident:
                    continue  # offloaded already, or on its way out
                nbytes = known[1]  # a read may still be refilling it: the chain orders them
            else:
                nbytes = tensor.untyped_storage().nbytes()
                whole = tensor.storage_offset() == 0 and nbytes == tensor.nbytes
                if tensor.device.type != "cpu" or not tensor.is_contiguous() or not whole:
                    raise ValueError(f"file offload needs CPU tensors owning their storage: {key}")
            file = self.directory / f"{key}.bin"
            self._entries[key] = (tensor, nbytes, file)
            self._resident.discard(key)
            self.bytes_written += nbytes
            self._after(key, _write_then_release, tensor, nbytes, file)

    def prefetch(self) -> None:
        """Start reading back everything that is offloaded."""
        for key, (tensor, nbytes, file) in self._entries.items():
            if key in self._resident:
                continue
            self._resident.add(key)
            self.bytes_read += nbytes
            self._after(key, _restore_then_read, tensor, nbytes, file)

    def wait(self) -> None:
        """Block until every transfer started so far has finished (re-raising I/O errors)."""
        pending, self._pending = self._pending, {}
        for future in pending.values():
            future.result()

    def fetch_all(self) -> None:
        """Make everything resident now (before reading the state outside a step)."""
        self.prefetch()
        self.wait()

    @property
    def offloaded_bytes(self) -> int:
        return sum(n for key, (_, n, _) in self._entries.items() if key not in self._resident)

    def forget(self) -> None:
        """Drop all entries (their tensors were replaced, e.g. by loading a state dict)."""
        self.wait()
        self._entries.clear()
        self._resident.clear()

    def close(self) -> None:
        self.wait()
        self._finalizer()


def master_device(offload_device: str, param_device: torch.device) -> torch.device:
    """Where fp32 master shards and optimizer state live."""
    return torch.device("cpu") if offload_device in ("cpu", "nvme") else param_device


def empty_on(device: torch.device, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zeroed buffer; pinned host memory when it will be copied to and from a GPU."""
    pin = device.type == "cpu" and torch.cuda.is_available()
    return torch.zeros(numel, dtype=dtype, device=device, pin_memory=pin)
