"""`[resilience]`: the NaN/Inf guard and fault injection, declared by the feature that owns them.

    [resilience]
    max_consecutive_nonfinite = 3      # stop after 3 steps in a row with NaN/Inf gradients

    [resilience.fault_injection]
    kill_after_step = 5                # SIGKILL rank 0 after step 5 (restart tests)

Both were keys of `[checkpoint_io]` (they matter to jobs that resume from checkpoints); a config
that still writes them there loads, moved here (`plait.core.config.MOVED_KEYS`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from plait.core.config import PlaitConfig
from plait.core.hookspecs import hookimpl
from plait.core.records import ConfigSectionRecord

SECTION = "resilience"


class FaultInjectionConfig(BaseModel):
    """`[resilience.fault_injection]`: kill a rank on purpose, to test restarts."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    kill_after_step: int = Field(-1, description="SIGKILL after this many steps; -1 = never")
    rank: int = Field(0, ge=0, description="the global rank that kills itself")
    only_first_attempt: bool = Field(
        True, description="only before the first torchrun restart (so the job can finish)"
    )
    scope: Literal["rank", "node"] = Field(
        "rank",
        description="'rank': the rank alone; 'node': its torchrun agent first (a node lost)",
    )
    signal: Literal["SIGKILL", "SIGSTOP"] = Field(
        "SIGKILL",
        description="'SIGKILL': the rank dies; 'SIGSTOP': it hangs, stopped with its "
        "connections open (scope 'rank' only)",
    )

    @model_validator(mode="after")
    def _stop_one_rank_only(self) -> FaultInjectionConfig:
        if self.signal == "SIGSTOP" and self.scope == "node":
            raise ValueError(
                "signal = 'SIGSTOP' stops one rank: it goes with scope = 'rank', not 'node'"
            )
        return self


class ResilienceConfig(BaseModel):
    """`[resilience]`: what keeps a job going, or stops it clearly, when a step goes wrong."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_consecutive_nonfinite: int = Field(
        3, ge=0, description="stop after N steps in a row with NaN/Inf gradients; 0 = no guard"
    )
    fault_injection: FaultInjectionConfig = Field(default_factory=FaultInjectionConfig)


def resilience_config(config: PlaitConfig) -> ResilienceConfig:
    """The job's `[resilience]` section (defaults where the file has none)."""
    return config.section(SECTION, ResilienceConfig)


@hookimpl
def plait_register_config_sections() -> Sequence[ConfigSectionRecord]:
    return [
        ConfigSectionRecord(
            name=SECTION,
            config_cls=ResilienceConfig,
            description="NaN/Inf guard and fault injection",
        )
    ]
