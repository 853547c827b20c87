"""The shared `[comm]` config section: which algorithm carries gradient traffic, and its knobs.

One section serves the three communication plugins (collectives, compression, param_server), so a
job selects exactly one algorithm by name and each plugin reads only its own sub-table::

    [comm]
    algorithm = "powersgd"

    [comm.powersgd]
    rank = 2
    warm_start = true
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from plait.core.config import Section
from plait.core.errors import ConfigError

# "torch" means no algorithm plugin takes anything over: the backend's collectives run as-is.
DEFAULT_ALGORITHM = "torch"


class RingConfig(Section):
    """Ring all-reduce: reduce-scatter then all-gather around the group, n-1 steps each."""

    purposes: list[str] = Field(
        default_factory=list,
        description="take over all-reduces with these purposes only; empty = every all-reduce",
    )


class TreeConfig(Section):
    """Recursive halving-doubling (Rabenseifner) all-reduce, recursive doubling when small."""

    purposes: list[str] = Field(
        default_factory=list,
        description="take over all-reduces with these purposes only; empty = every all-reduce",
    )
    small_message_bytes: int = Field(
        16 * 1024,
        ge=0,
        description="below this size exchange whole vectors (log2 p steps, latency-bound)",
    )


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


class ParamServerConfig(Section):
    """Colocated parameter server: every rank is a worker, the first `num_servers` also serve."""

    mode: Literal["sync", "async"] = Field(
        "sync", description="sync = every pull sees this step's pushes; async = bounded staleness"
    )
    staleness: int = Field(
        1, ge=0, description="async only: a pull may be this many steps behind the push"
    )
    num_servers: int = Field(
        0, ge=0, description="ranks that serve a shard of each bucket; 0 = every rank"
    )

    @property
    def effective_staleness(self) -> int:
        return self.staleness if self.mode == "async" else 0


class CommConfig(Section):
    """The `[comm]` section: `algorithm` picks one plugin; sub-tables configure each one."""

    algorithm: str = Field(
        DEFAULT_ALGORITHM,
        description="torch, ring, tree, fp16, bf16, powersgd, topk, param_server, or a plugin's",
    )
    ring: RingConfig = Field(default_factory=RingConfig)
    tree: TreeConfig = Field(default_factory=TreeConfig)
    fp16: CastConfig = Field(default_factory=CastConfig)
    bf16: CastConfig = Field(default_factory=CastConfig)
    powersgd: PowerSGDConfig = Field(default_factory=PowerSGDConfig)
    topk: TopKConfig = Field(default_factory=TopKConfig)
    param_server: ParamServerConfig = Field(default_factory=ParamServerConfig)

    @model_validator(mode="after")
    def _algorithm_is_a_name(self) -> CommConfig:
        if not self.algorithm.strip():
            raise ValueError("comm.algorithm must name an algorithm, e.g. 'torch' or 'ring'")
        return self


def check_algorithm(algorithm: str, registered: set[str] | dict[str, object]) -> None:
    """Fail with the installed alternatives when `algorithm` is neither "torch" nor registered.

    `registered` is what `Plugins.comm_algorithms()` returns (or just its names).
    """
    if algorithm == DEFAULT_ALGORITHM or algorithm in registered:
        return
    installed = ", ".join(sorted({DEFAULT_ALGORITHM, *registered}))
    raise ConfigError(
        f"comm.algorithm: no installed plugin provides {algorithm!r}; installed: {installed}"
    )
