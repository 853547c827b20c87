"""Launching where clusters launch: what `plait train` derives from a Slurm allocation.

Under Slurm, `srun plait train CONFIG …` runs one launcher per node. Each one reads the job's
variables — `SLURM_JOB_ID`, `SLURM_NNODES`, `SLURM_NODEID`, `SLURM_JOB_NODELIST` (or
`SLURM_NODELIST`) — and derives torchrun's multi-node options: `--nnodes` (the node count),
`--node-rank`, the rendezvous endpoint (the first host of the node list, on the rendezvous port)
and the rendezvous id (the job id, so two jobs never share a rendezvous). Options given on the
command line win over what is derived.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from plait.core.errors import ConfigError

DEFAULT_RDZV_PORT = 29400  # torchrun's c10d rendezvous port


@dataclass(frozen=True, slots=True)
class SlurmLaunch:
    """The torchrun options one node's launcher takes from its Slurm allocation."""

    job_id: str
    nnodes: int
    node_rank: int
    hosts: tuple[str, ...]
    rdzv_port: int

    @property
    def rdzv_endpoint(self) -> str:
        return f"{self.hosts[0]}:{self.rdzv_port}"

    def describe(self) -> str:
        return (
            f"Slurm job {self.job_id}: node {self.node_rank} of {self.nnodes}, rendezvous at "
            f"{self.rdzv_endpoint} (id {self.job_id})"
        )


def slurm_launch(
    env: Mapping[str, str], *, rdzv_port: int = DEFAULT_RDZV_PORT
) -> SlurmLaunch | None:
    """The launch the Slurm variables in `env` describe, or `None` outside a Slurm job step."""
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not job_id or not nodelist or "SLURM_NNODES" not in env or "SLURM_NODEID" not in env:
        return None
    try:
        nnodes, node_rank = int(env["SLURM_NNODES"]), int(env["SLURM_NODEID"])
    except ValueError:
        raise ConfigError(
            f"SLURM_NNODES={env['SLURM_NNODES']!r} / SLURM_NODEID={env['SLURM_NODEID']!r} are "
            "not integers"
        ) from None
    hosts = tuple(expand_hostlist(nodelist))
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"SLURM_NODEID={node_rank} is outside SLURM_NNODES={nnodes}")
    return SlurmLaunch(
        job_id=job_id, nnodes=nnodes, node_rank=node_rank, hosts=hosts, rdzv_port=rdzv_port
    )


_BRACKETS = re.compile(r"([^,\[]*)\[([^\]]*)\]([^,]*)")


def expand_hostlist(text: str) -> list[str]:
    """Expand Slurm's compressed host list: `gpu[01-03,07],login1` → gpu01 … gpu07, login1.

    Zero padding follows the range's first bound, as `scontrol show hostnames` does. (One bracket
    group per host name, which is what Slurm writes for plain node names.)
    """
    hosts: list[str] = []
    for item in _split_top_level(text):
        match = _BRACKETS.fullmatch(item)
        if match is None:
            if "[" in item or "]" in item:
                raise ConfigError(f"cannot read the Slurm host list {text!r}")
            hosts.append(item)
            continue
        prefix, ranges, suffix = match.groups()
        for part in ranges.split(","):
            low, _, high = part.partition("-")
            width = len(low)
            for number in range(int(low), int(high or low) + 1):
                hosts.append(f"{prefix}{number:0{width}d}{suffix}")
    if not hosts:
        raise ConfigError(f"the Slurm host list {text!r} names no host")
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets."""
    items, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            items.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        current += char
    items.append(current)
    return [item for item in items if item]
