"""Who a rank is, as the resource attributes it sends the daemon (`plait.daemon.telemetry_schema`
names), and the peak FLOP/s its MFU is divided by.

The daemon's MFU divides model FLOP/s by the peak put in the resource, from
`plait.daemon.peak_flops`: the dense datasheet figure for the job's compute dtype on a known
accelerator (exact device name), the host's cached GEMM calibration on CPU. No OpenTelemetry
import: any producer (the telemetry plugin, a benchmark, a test) builds the same resource.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from plait.daemon import telemetry_schema as schema
from plait.daemon.peak_flops import PeakFlops, peak_flops_for

if TYPE_CHECKING:
    from plait.core.step import JobInfo

__all__ = ["PeakFlops", "peak_flops_for_job", "resource_attributes", "restart_attempt"]


def peak_flops_for_job(info: JobInfo) -> PeakFlops:
    """The rank's peak for the job's compute dtype (`JobInfo.compute_dtype`: under autocast the
    precision policy's dtype, not the parameters')."""
    return peak_flops_for(info.device, info.device_name, info.compute_dtype)


def restart_attempt() -> int:
    """torchrun's restart count for this launcher (0 outside torchrun or before a restart)."""
    value = os.environ.get("TORCHELASTIC_RESTART_COUNT", "")
    return int(value) if value.isdigit() else 0


def resource_attributes(info: JobInfo, peak: PeakFlops) -> dict[str, Any]:
    """The OpenTelemetry resource of one rank (semantic-convention names where they exist)."""
    attributes: dict[str, Any] = {
        "service.name": "plait",
        "service.instance.id": f"{info.job_id}/{info.rank}",
        schema.RESOURCE_HOST_NAME: info.host,
        schema.RESOURCE_PROCESS_PID: os.getpid(),
        schema.RESOURCE_JOB_ID: info.job_id,
        schema.RESOURCE_RANK: info.rank,
        schema.RESOURCE_LOCAL_RANK: info.local_rank,
        schema.RESOURCE_WORLD_SIZE: info.world_size,
        # torchrun counts its restarts; a new attempt is a new world of the job for the daemon.
        schema.RESOURCE_RESTART_ATTEMPT: restart_attempt(),
        schema.RESOURCE_DEVICE: info.device,
        schema.RESOURCE_DEVICE_NAME: info.device_name,
        schema.RESOURCE_COMPUTE_DTYPE: info.compute_dtype,
        schema.RESOURCE_PEAK_FLOPS: float(peak.flops),
        schema.RESOURCE_PEAK_FLOPS_SOURCE: peak.source,
        schema.RESOURCE_MODEL_NAME: info.model_name,
        schema.RESOURCE_NUM_PARAMS: int(info.num_params),
        schema.RESOURCE_FLOPS_PER_TOKEN: float(info.flops_per_token),
        schema.RESOURCE_TOKENS_PER_STEP: int(info.tokens_per_step),
    }
    if info.replica_group >= 0:
        # Each replica group is a world of its own: its rank 0 is not the other groups'.
        attributes[schema.RESOURCE_REPLICA_GROUP] = int(info.replica_group)
        attributes["service.instance.id"] = f"{info.job_id}/{info.replica_group}/{info.rank}"
    for axis, coordinate in info.coordinates.items():
        attributes[schema.RESOURCE_MESH_COORD_PREFIX + axis] = int(coordinate)
    for axis, degree in info.degrees.items():
        attributes[schema.RESOURCE_MESH_DEGREE_PREFIX + axis] = int(degree)
    return attributes
