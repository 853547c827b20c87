"""The torch reference `grouped_mm`: one matrix multiply per group of consecutive rows.

`grouped_mm(x, weight, counts) -> y`: `x` (N, K) holds the rows of group 0, then group 1, …
(`counts[g]` rows each, `counts` summing to N); `weight` (G, M, K) holds one matrix per group in
`nn.Linear`'s (out, in) convention; `y[rows of g] = x[rows of g] @ weight[g].T`, shape (N, M).
Mixture-of-experts layers run their experts with it (the rows are the tokens routed to each
expert). This loop over groups is autograd-correct by construction and is the ground truth for
faster providers; `torch._grouped_mm` is used where torch provides it for the device and dtype
(bf16 on recent NVIDIA GPUs), since it does the same in one launch.
"""

from __future__ import annotations

import torch

PROVIDER = "torch"


def _fused_available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and x.is_cuda
        and x.dtype == torch.bfloat16
        and weight.dtype == torch.bfloat16
        and torch.cuda.get_device_capability(x.device) >= (9, 0)
    )


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Per-group `x_g @ weight[g].T` over consecutive row groups of sizes `counts`."""
    if counts.numel() != weight.shape[0]:
        raise ValueError(f"{counts.numel()} group sizes for {weight.shape[0]} weight matrices")
    if _fused_available(x, weight):
        offsets = counts.cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets)
    sizes = counts.tolist()
    pieces = [rows @ weight[g].T for g, rows in enumerate(x.split(sizes, dim=0))]
    if not pieces:
        return x.new_zeros(0, weight.shape[1])
    return torch.cat(pieces, dim=0)


grouped_mm.plait_provider = PROVIDER  # type: ignore[attr-defined]
