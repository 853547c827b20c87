"""Who an observed rank is: rank, world, host and job from the launcher, the device and the
model from the module itself — the `JobInfo` plait's own ranks send, for a job plait did not
launch.

Rank and world size come from `torch.distributed` once it is initialised, else from torchrun
(`RANK`, `WORLD_SIZE`, `LOCAL_RANK`), else from Slurm (`SLURM_PROCID`, `SLURM_NTASKS`,
`SLURM_LOCALID`), else one process. The job id is the one given, else `$PLAIT_JOB_ID`, else
torchrun's rendezvous id (`TORCHELASTIC_RUN_ID`, a fresh uuid per `--standalone` launch),
else Slurm's `SLURM_JOB_ID`, else "local". Every rank of a job must reach the same id
without talking to the others, which these variables give.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from plait.core.errors import PlaitError
from plait.core.host import cpu_model, host_name
from plait.core.host_map import HostMap
from plait.core.step import JobInfo

LOCAL_JOB_ID = "local"
# torchrun's run id when none was given and the rendezvous is not standalone: not a job's.
TORCHRUN_DEFAULT_RUN_ID = "none"


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchIdentity:
    """What the launcher says about this process."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    host: str


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise PlaitError(f"plait.observe: ${name} must be an integer, got {value!r}") from None


def launch_identity(
    job_id: str | None = None, env: Mapping[str, str] | None = None
) -> LaunchIdentity:
    """This process's rank, world, host and job (see the module docstring for the order)."""
    env = os.environ if env is None else env
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    elif _int(env, "RANK") is not None:
        rank, world = _int(env, "RANK") or 0, _int(env, "WORLD_SIZE") or 1
    elif _int(env, "SLURM_PROCID") is not None:
        rank, world = _int(env, "SLURM_PROCID") or 0, _int(env, "SLURM_NTASKS") or 1
    else:
        rank, world = 0, 1
    local = _int(env, "LOCAL_RANK")
    if local is None:
        local = _int(env, "SLURM_LOCALID")
    if job_id is not None and not job_id.strip():
        raise PlaitError("plait.observe: job_id must be a non-empty string or None")
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if run_id == TORCHRUN_DEFAULT_RUN_ID:
        run_id = ""
    chosen = (
        job_id
        or env.get("PLAIT_JOB_ID", "").strip()
        or run_id
        or env.get("SLURM_JOB_ID", "").strip()
        or LOCAL_JOB_ID
    )
    return LaunchIdentity(
        job_id=chosen, rank=rank, local_rank=local or 0, world_size=world, host=host_name(env)
    )


def launch_host_map(world_size: int, env: Mapping[str, str] | None = None) -> HostMap | None:
    """Which ranks share a node, from what the launcher says without asking the other ranks:
    torchrun gives each of its `GROUP_WORLD_SIZE` agents `LOCAL_WORLD_SIZE` workers and numbers
    them agent after agent; Slurm's `SLURM_NNODES` nodes run `SLURM_NTASKS_PER_NODE` tasks each,
    numbered node after node under its default block distribution. None when the launcher does
    not say, or its figures do not multiply to the world (uneven nodes): no link bytes then."""
    env = os.environ if env is None else env
    for nodes_name, per_node_name in (
        ("GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        ("SLURM_NNODES", "SLURM_NTASKS_PER_NODE"),
    ):
        nodes, per_node = env.get(nodes_name, "").strip(), env.get(per_node_name, "").strip()
        if nodes.isdigit() and per_node.isdigit() and int(nodes) * int(per_node) == world_size:
            # Only this rank's host is known; the others' names stay blank.
            host = host_name(env) if int(nodes) == 1 else ""
            return HostMap.assumed(int(nodes), int(per_node), host)
    return None


def unwrapped(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP (or DataParallel) wrapper."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, nn.Module) else model


def model_device(model: nn.Module) -> torch.device:
    for tensor in (*model.parameters(), *model.buffers()):
        return tensor.device
    return torch.device("cpu")


def compute_dtype(model: nn.Module, device: torch.device) -> torch.dtype:
    """The dtype matmuls run in: autocast's when it is on, else FSDP2's mixed-precision
    parameter dtype, else the first floating parameter's."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    for module in model.modules():
        policy = getattr(module, "_get_fsdp_state", None)
        if policy is None:
            continue
        for group in policy()._fsdp_param_groups:
            param_dtype = group.mp_policy.param_dtype
            if param_dtype is not None:
                return param_dtype
    for parameter in model.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return torch.float32


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def observed_job_info(
    model: nn.Module,
    launch: LaunchIdentity,
    *,
    flops_per_token: float,
    tokens_per_step: int,
    memory_report: Callable[[], dict[str, int]] | None = None,
) -> JobInfo:
    """The `JobInfo` of an observed rank: one data-parallel axis over the world
    (`memory_report`: what `plait memory` counts of the model's state on this rank)."""
    device = model_device(model)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return JobInfo(
        job_id=launch.job_id,
        rank=launch.rank,
        local_rank=launch.local_rank,
        world_size=launch.world_size,
        host=launch.host,
        degrees={"dp": launch.world_size},
        coordinates={"dp": launch.rank},
        device=str(device),
        device_name=device_name(device),
        compute_dtype=str(compute_dtype(model, device)).removeprefix("torch."),
        model_name=type(unwrapped(model)).__name__,
        # A sharded (DTensor) parameter's numel is its global size.
        num_params=sum(p.numel() for p in model.parameters()),
        flops_per_token=flops_per_token,
        tokens_per_step=tokens_per_step,
        memory_report=memory_report,
    )
