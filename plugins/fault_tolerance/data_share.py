"""Which share of the global batch a data-parallel rank of one replica group reads."""

from __future__ import annotations

from plait.plugins.fault_tolerance.config import FaultToleranceConfig


def replica_data_coordinates(
    *, dp_rank: int, dp_size: int, settings: FaultToleranceConfig
) -> tuple[int, int]:
    """`(rank, size)` for the data sampler: the groups split the global batch like one big
    data-parallel axis, group-major, so group g's rank r reads what rank g·dp + r of a single job
    with dp · groups ranks would. A step without some groups averages over the participants'
    rows only (the global batch shrinks by the missing groups' share)."""
    if not settings.enabled:
        return dp_rank, dp_size
    return settings.replica_group * dp_size + dp_rank, settings.replica_groups * dp_size
