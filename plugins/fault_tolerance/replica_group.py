"""One replica group's torchft `Manager`: its store, its cross-group process group, its lighthouse.

Every rank of the group builds one. Group rank 0 runs the manager server that talks to the
lighthouse and a TCP store for the group; the other ranks learn the store's port over the group's
own process group (so it works under torchrun, Slurm or a one-process run alike).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plait.core.errors import ConfigError
from plait.plugins.fault_tolerance.config import FaultToleranceConfig


def require_torchft() -> Any:
    """The torchft module, or a `ConfigError` saying which extra installs it."""
    try:
        import torchft
    except ImportError:
        raise ConfigError(
            "fault_tolerance.replica_group is set but torchft is not installed; install the "
            "extra: pip install 'plait[ft]'"
        ) from None
    return torchft


def advertised_host() -> str:
    """The address peers reach this group's store and manager at: the group's rendezvous host
    under torchrun (reachable by construction), else this host's name."""
    host = os.environ.get("MASTER_ADDR", "")
    if host and host not in ("localhost", "0.0.0.0"):
        return host
    return "127.0.0.1" if host == "localhost" else socket.gethostname()


def lighthouse_url(address: str) -> str:
    """torchft's clients want a URL; plait's config and CLI speak HOST:PORT."""
    return address if "://" in address else f"http://{address}"


def open_manager(
    *,
    settings: FaultToleranceConfig,
    job_id: str,
    device: torch.device,
    state_dict: Callable[[], dict[str, Any]],
    load_state_dict: Callable[[dict[str, Any]], None],
) -> tuple[Any, Any]:
    """This rank's `(manager, store)`; keep the store alive as long as the manager."""
    torchft = require_torchft()
    group_rank, group_size = dist.get_rank(), dist.get_world_size()
    host = advertised_host()
    store = None
    port = [0]
    if group_rank == 0:
        store = dist.TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
        port = [store.port]
    dist.broadcast_object_list(port, src=0)
    step_timeout = timedelta(seconds=settings.step_timeout_seconds)
    # NOTE: Gloo on CPU; NCCL groups are rebuilt by torchft on every quorum change.
    cross_group = (
        torchft.ProcessGroupNCCL(timeout=step_timeout)
        if device.type == "cuda"
        else torchft.ProcessGroupGloo(timeout=step_timeout)
    )
    manager = torchft.Manager(
        pg=cross_group,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        min_replica_size=settings.min_replica_groups,
        # Quorum (and a heal) completes before the forward: the step that follows trains on the
        # healed weights, and nothing reads the state while it is sent.
        use_async_quorum=False,
        timeout=step_timeout,
        quorum_timeout=timedelta(seconds=settings.quorum_timeout_seconds),
        connect_timeout=timedelta(seconds=settings.connect_timeout_seconds),
        rank=group_rank,
        world_size=group_size,
        store_addr=host,
        store_port=port[0],
        lighthouse_addr=lighthouse_url(settings.lighthouse),
        # torchft reads the group's index from the id's trailing digits.
        replica_id=f"{job_id}-group{settings.replica_group}",
        hostname=host,
        # Every group builds its weights from the same seed: nothing to copy at step 0.
        init_sync=False,
    )
    return manager, store
