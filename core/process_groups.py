"""The process groups plait creates end before the interpreter does.

Why. A Gloo process group runs its collectives on worker threads of its own
(`pt_gloo_runloop`), joined only when the group is freed. Left alive into interpreter shutdown,
a worker that has just completed the run's last collective drops that op's tensors a moment
after the training thread moved on. When that moment falls after Python began finalizing,
freeing the tensors' Python objects needs the GIL, CPython ends the thread from inside that
acquire, the unwinding meets a `noexcept` destructor and the C++ runtime aborts:
"terminate called without an active exception", SIGABRT, and a run that trained every step
exits non-zero (torchrun restarts it, Slurm marks it failed).

What plait does. When plait itself initialises the default process group (`plait.initialize`
or `Engine` under torchrun, or as one plain process), it destroys every process group at
interpreter exit (an `atexit` handler, which runs while the interpreter is still whole),
after dropping the device meshes of its `Mesh` objects (a `DeviceMesh` holds its groups).
Everything else plait holds names its groups weakly (`plait.core.comm.Group`), so destroying
them frees them and joins their worker threads. A script that ends by raising is left alone:
its peers may still be inside a collective, and joining a worker blocked in one would hang
the exit instead of ending it. A process group the caller initialised is the caller's to
destroy (`torch.distributed.destroy_process_group()`, as torch documents).

    init_distributed(device)        # plait.core.mesh: creates the group, calls adopt()
    ...                             # training
    # interpreter exit: release_meshes(), destroy_process_group(), Gloo workers joined
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import weakref
from pathlib import Path
from typing import Protocol

import torch.distributed as dist

__all__ = ["adopt", "gloo_worker_threads", "owns_process_group", "teardown", "track_mesh"]

log = logging.getLogger("plait.process_groups")

GLOO_WORKER_THREAD = "pt_gloo_runloop"  # the name c10d gives a Gloo group's worker threads


class ReleasableMesh(Protocol):
    def release(self) -> None:
        """Drop every reference to process groups (the device mesh, cached groups)."""


_state = {"owned": False, "registered": False}
_meshes: weakref.WeakValueDictionary[int, ReleasableMesh] = weakref.WeakValueDictionary()


def adopt() -> None:
    """Record that plait created the default process group, so plait destroys it at exit."""
    _state["owned"] = True
    _register()


def _register() -> None:
    if not _state["registered"]:
        atexit.register(_at_exit)
        _state["registered"] = True


def owns_process_group() -> bool:
    """Whether plait created the live default process group (and will destroy it)."""
    return _state["owned"] and dist.is_available() and dist.is_initialized()


def track_mesh(mesh: ReleasableMesh) -> None:
    """Remember `mesh`, to drop its device mesh at exit (before the groups are destroyed)."""
    _meshes[id(mesh)] = mesh
    _register()


def teardown() -> None:
    """Drop plait's meshes, then destroy the process groups plait created, which frees them
    and joins their worker threads. A group the caller created and already destroyed is freed
    here too (the meshes were its last holders).

    Collective-free for Gloo; call it on every rank once no rank will issue another op.
    """
    for mesh in list(_meshes.values()):
        mesh.release()
    _meshes.clear()
    if owns_process_group():
        dist.destroy_process_group()
    _state["owned"] = False
    if dist.is_initialized():
        return  # the caller's groups, still in use: theirs to destroy
    left = gloo_worker_threads()
    if left:
        gc.collect()  # a group kept only by a reference cycle (slow: the whole heap is walked)
        left = gloo_worker_threads()
    if left:
        log.warning(
            "plait: %d Gloo worker thread(s) outlive the destroyed process groups: something "
            "still references a process group (drop it before the interpreter exits)",
            left,
        )


def gloo_worker_threads() -> int:
    """How many Gloo worker threads this process runs now (0 where /proc is absent)."""
    tasks = Path(f"/proc/{os.getpid()}/task")
    count = 0
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return 0
    for task in entries:
        try:
            count += (task / "comm").read_text().strip() == GLOO_WORKER_THREAD
        except OSError:  # the thread ended while we looked
            continue
    return count


def _at_exit() -> None:
    if getattr(sys, "last_value", None) is not None:
        return  # the script raised: leave the groups to the process's end (see module doc)
    teardown()
