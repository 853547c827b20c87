"""PowerSGD (Vogels, Karimireddy & Jaggi, 2019): rank-r gradient compression by one power step.

The bucket (plus the error left over from the last step) is viewed as a square `s × s` matrix
`M`, zero-padded — the batched variant of PyTorch's `batched_powerSGD_hook`, which needs no
parameter shapes. Per step, with `Q` (`s × r`) shared by all ranks:

1. `P = M Q`, all-reduced (sum), then orthonormalised (QR);
2. `Q = Mᵀ P`, all-reduced (sum or average);
3. the result is `P Qᵀ`, the projection of the averaged gradient on span(P).

Warm start keeps `Q` for the next step, so the single power iteration per step keeps refining
the same subspace; error feedback adds `M − P Qᵀ` (what this rank's gradient lost) to the next
step's bucket. Bytes per rank: `2 s r` fp32 values instead of `n ≈ s²`, a factor `s / 2r`.
A bucket too small to gain (`2 s r ≥ n`) and the first `start_step` steps use a plain all-reduce,
which lets the error-feedback memory start from a sensible point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from plait.core.comm import Comm, Group


@dataclass(slots=True)
class PowerSGDState:
    """What one bucket carries from step to step."""

    error: torch.Tensor | None = None
    q: torch.Tensor | None = None
    steps: int = 0


def matrix_side(numel: int) -> int:
    return math.isqrt(numel - 1) + 1 if numel > 0 else 0


def compressed_elements(numel: int, rank: int) -> int:
    """Elements of P and Q one rank all-reduces for a bucket of `numel` elements."""
    side = matrix_side(numel)
    return 2 * side * min(rank, side)


def powersgd_all_reduce(
    comm: Comm,
    tensor: torch.Tensor,
    *,
    state: PowerSGDState,
    rank: int,
    warm_start: bool,
    error_feedback: bool,
    start_step: int,
    seed: int,
    group: Group,
    reduce_op: str,
    purpose: str,
) -> None:
    """All-reduce `tensor` in place through a rank-`rank` approximation."""
    numel = tensor.numel()
    step = state.steps
    state.steps += 1
    if step < start_step or compressed_elements(numel, rank) >= numel:
        comm.all_reduce(tensor, group=group, op=reduce_op, purpose=purpose).wait()
        return

    side = matrix_side(numel)
    rank = min(rank, side)
    padded = torch.zeros(side * side, dtype=torch.float32, device=tensor.device)
    padded[:numel] = tensor.detach().reshape(-1)
    if error_feedback and state.error is not None:
        padded[:numel] += state.error
    matrix = padded.view(side, side)

    if state.q is None or not warm_start:
        # Identical on every rank: the seed depends only on the config and the step.
        generator = torch.Generator().manual_seed(seed * 1_000_003 + (0 if warm_start else step))
        state.q = torch.randn(side, rank, generator=generator).to(tensor.device)

    p = matrix @ state.q
    comm.all_reduce(p, group=group, op="sum", purpose=purpose).wait()
    # Every rank holds the same P, so every rank computes the same orthonormal basis.
    p = torch.linalg.qr(p, mode="reduced").Q
    q = matrix.t() @ p
    comm.all_reduce(q, group=group, op="sum", purpose=purpose).wait()
    if reduce_op == "avg":
        q /= group.size

    approximation = (p @ q.t()).view(-1)[:numel]
    if error_feedback:
        state.error = padded[:numel] - approximation
    if warm_start:
        state.q = q
    tensor.copy_(approximation.view(tensor.shape))
