"""What `plait train` derives from a Slurm allocation."""

from __future__ import annotations

import pytest

from plait.core.errors import ConfigError
from plait.tools.slurm import expand_hostlist, slurm_launch


def test_host_lists_expand_as_scontrol_does() -> None:
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("a[8-10]-ib") == ["a8-ib", "a9-ib", "a10-ib"]
    assert expand_hostlist("node7") == ["node7"]
    with pytest.raises(ConfigError, match="cannot read"):
        expand_hostlist("gpu[01-03")


def test_the_launch_comes_from_the_job_variables() -> None:
    env = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "3",
        "SLURM_NODEID": "2",
        "SLURM_JOB_NODELIST": "trn[005-007]",
    }
    launch = slurm_launch(env, rdzv_port=29555)
    assert launch is not None
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.job_id) == (
        3,
        2,
        "trn005:29555",
        "4242",
    )
    assert "node 2 of 3" in launch.describe()
    assert slurm_launch({"SLURM_JOB_ID": "1"}) is None  # not inside a job step
    with pytest.raises(ConfigError, match="outside SLURM_NNODES"):
        slurm_launch({**env, "SLURM_NODEID": "3"})


def test_the_host_name_can_be_set() -> None:
    from plait.core.host import host_name

    assert host_name({"PLAIT_HOST_NAME": "rack3-node7"}) == "rack3-node7"
    assert host_name({"OTEL_RESOURCE_ATTRIBUTES": "service.name=x,host.name=gpu-12"}) == "gpu-12"
    assert host_name({}) != ""
