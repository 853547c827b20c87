"""`[fault_tolerance]`: this job as one of several replica groups, declared by the plugin that
keeps them (see docs/fault-tolerance.md)::

    [fault_tolerance]
    replica_group = 0                 # this group's index; -1 (the default) = off
    replica_groups = 2
    lighthouse = "10.0.0.1:29510"     # plait daemon --lighthouse 10.0.0.1:29510

The plugin also tells the engine the rank's replica group (`plait_replica_group`), which its
`JobInfo` carries to telemetry and the daemon from the job's start.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field, model_validator

from plait.core.config import PlaitConfig, Section
from plait.core.hookspecs import hookimpl
from plait.core.records import ConfigSectionRecord

SECTION = "fault_tolerance"


class FaultToleranceConfig(Section):
    """`[fault_tolerance]`: this job is one of several replica groups kept by torchft's quorum.

    Each group is one `plait train` (its own torchrun world, any inner layout); a lighthouse
    (`plait daemon --lighthouse HOST:PORT`) forms a quorum of the live groups every step; a step
    commits only where every rank of the group succeeded, and a group that joins late heals from
    a live peer. See docs/fault-tolerance.md.
    """

    replica_group: int = Field(
        -1, ge=-1, description="this group's index, 0 .. replica_groups-1; -1 = fault tolerance off"
    )
    replica_groups: int = Field(
        1, gt=0, description="groups the job is made of; each reads its share of the global batch"
    )
    lighthouse: str = Field(
        "",
        description="HOST:PORT of the lighthouse that forms the quorum (plait daemon --lighthouse)",
    )
    min_replica_groups: int = Field(
        1, gt=0, description="fewest live groups a step may commit with"
    )
    quorum_timeout_seconds: float = Field(
        60.0, gt=0, description="how long a step waits for the lighthouse's quorum"
    )
    step_timeout_seconds: float = Field(
        60.0,
        gt=0,
        description="a cross-group all-reduce, commit vote or heal transfer that takes longer "
        "fails the step (not committed, retried without the group that stopped answering)",
    )
    connect_timeout_seconds: float = Field(
        10.0, gt=0, description="how long to wait to reach the lighthouse and peer managers"
    )
    keep_global_batch: bool = Field(
        False,
        description="a step without some groups still trains on the whole global batch: the "
        "live groups also read the missing groups' shares (as extra micro-batches) and the "
        "cross-group average weighs each group by its tokens; false = the step averages over "
        "the live groups' shares only (the global batch shrinks while groups are missing)",
    )

    @property
    def enabled(self) -> bool:
        return self.replica_group >= 0

    @model_validator(mode="after")
    def _group_and_lighthouse(self) -> FaultToleranceConfig:
        if not self.enabled:
            if self.keep_global_batch:
                raise ValueError(
                    "keep_global_batch = true only acts across replica groups, but "
                    "replica_group = -1 (fault tolerance off); set replica_group, or leave "
                    "keep_global_batch unset"
                )
            return self
        if self.replica_group >= self.replica_groups:
            raise ValueError(
                f"replica_group = {self.replica_group} is not one of the job's "
                f"replica_groups = {self.replica_groups}; allowed: 0 .. {self.replica_groups - 1}"
            )
        if self.min_replica_groups > self.replica_groups:
            raise ValueError(
                f"min_replica_groups = {self.min_replica_groups} exceeds replica_groups = "
                f"{self.replica_groups}; allowed: 1 .. {self.replica_groups}"
            )
        host, sep, port = self.lighthouse.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(
                f"lighthouse = {self.lighthouse!r} must be HOST:PORT (the address given to "
                "plait daemon --lighthouse), e.g. '127.0.0.1:29510', when replica_group is set"
            )
        return self


def fault_tolerance_config(config: PlaitConfig) -> FaultToleranceConfig:
    """The job's `[fault_tolerance]` section (defaults, fault tolerance off, where the file has
    none)."""
    return config.section(SECTION, FaultToleranceConfig)


@hookimpl
def plait_register_config_sections() -> Sequence[ConfigSectionRecord]:
    return [
        ConfigSectionRecord(
            name=SECTION,
            config_cls=FaultToleranceConfig,
            description="replica groups on torchft's quorum",
        )
    ]


@hookimpl
def plait_replica_group(config: PlaitConfig) -> int | None:
    """The rank's replica group when `[fault_tolerance]` names one (else not ours to say)."""
    section = fault_tolerance_config(config)
    return section.replica_group if section.enabled else None
