"""Options of the compression algorithms: `[comm.fp16]`, `[comm.bf16]`, `[comm.powersgd]`,
`[comm.topk]`, each the `config_cls` of its `CommAlgorithmRecord`::

    [comm]
    algorithm = "powersgd"

    [comm.powersgd]
    rank = 2
    warm_start = true
"""

from __future__ import annotations

from pydantic import Field

from plait.core.config import Section


class CastConfig(Section):
    """fp16 / bf16 bucket compression: cast, all-reduce in half precision, cast back."""

    prescale: bool = Field(
        True, description="divide by the group size before casting so fp16 sums cannot overflow"
    )


class PowerSGDConfig(Section):
    """PowerSGD (Vogels et al., 2019) on the bucket viewed as a square matrix."""

    rank: int = Field(2, gt=0, description="rank r of the low-rank approximation P·Qᵀ")
    warm_start: bool = Field(True, description="reuse last step's Q instead of a fresh random one")
    error_feedback: bool = Field(True, description="add last step's compression error back in")
    start_step: int = Field(
        0, ge=0, description="plain all-reduce for this many steps per bucket before compressing"
    )
    seed: int = Field(0, description="seed for the initial Q, identical on every rank")


class TopKConfig(Section):
    """Top-k sparsification: each rank sends its k largest-magnitude entries and their indices."""

    ratio: float = Field(0.01, gt=0, le=1, description="fraction of entries each rank sends")
    error_feedback: bool = Field(True, description="keep unsent entries and add them next step")
