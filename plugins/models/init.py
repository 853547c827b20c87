"""Deterministic, placement-independent parameter initialisation, keyed by parameter name.

A parameter's values depend only on (seed, its fully-qualified name, its global shape): they are
drawn on the CPU from a `torch.Generator` seeded with a stable hash of the seed and the name, then
copied to the parameter's device. So a model built on the meta device and materialised with
`to_empty` + `init_weights`, a pipeline stage holding a few layers, or a tensor-parallel shard
(a DTensor takes its local slice of the same full tensor) all hold exactly the values of the
full model initialised in one piece.
"""

from __future__ import annotations

import hashlib
from typing import Literal

import torch

# Re-exported: the name rule lives in the core, where checkpoints and exports use it too.
from plait.core.names import normalised_name as normalised_name


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed from (seed, name), stable across processes and Python versions.

    Python's `hash` is salted per process, so a cryptographic digest is used instead.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def full_initial_value(
    shape: torch.Size | tuple[int, ...],
    *,
    seed: int,
    name: str,
    kind: Literal["normal", "ones", "zeros"],
    std: float = 0.02,
) -> torch.Tensor:
    """The float32 CPU tensor a parameter of global `shape` named `name` is initialised to."""
    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    generator = torch.Generator(device="cpu").manual_seed(parameter_seed(seed, name))
    return torch.empty(shape).normal_(0.0, std, generator=generator)


def _local_slice(param: torch.Tensor, full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(destination, source): the tensor to write into, and its part of the full value."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch built without distributed
        return param, full
    if not isinstance(param, DTensor):
        return param, full
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local_shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    index = tuple(
        slice(start, start + size) for start, size in zip(offset, local_shape, strict=True)
    )
    return param.to_local(), full[index]


@torch.no_grad()
def init_parameter(
    param: torch.Tensor,
    *,
    seed: int,
    name: str,
    kind: Literal["normal", "ones", "zeros"],
    std: float = 0.02,
) -> None:
    """Fill `param` in place with its name-determined value; meta tensors are left alone."""
    if param.is_meta:
        return
    full = full_initial_value(param.shape, seed=seed, name=name, kind=kind, std=std)
    destination, source = _local_slice(param, full)
    destination.copy_(source)
