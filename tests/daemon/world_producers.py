"""A rank producer in its own process: real OTLP exports through plait's telemetry plugin.

`produce` runs steps in real time until `steps` are done or the process is killed, as a
training rank would; the tests kill it to play a lost node and start another with
a new world size and restart attempt to play torchrun's restart.
"""

from __future__ import annotations

import math
import os
import time

from plait.core.config import load_config
from plait.core.plugins import Plugins
from plait.core.step import PhaseSpan, StepReport
from plait.plugins.telemetry import make_plugin
from tests.daemon.daemon_fakes import job_info

TOKENS = 512
MODEL_FLOPS = 2.0e8  # far below any CPU's calibrated peak: MFU stays a figure


def report(step: int, start_ns: int, end_ns: int) -> StepReport:
    middle = (start_ns + end_ns) // 2
    spans = (
        PhaseSpan(name="forward", start_ns=start_ns, end_ns=middle, microbatch=0),
        PhaseSpan(name="backward", start_ns=middle, end_ns=end_ns, microbatch=0),
    )
    return StepReport(
        step=step,
        loss=2.0,
        tokens=TOKENS,
        step_seconds=(end_ns - start_ns) / 1e9,
        data_wait_seconds=0.0,
        model_flops=MODEL_FLOPS,
        lr=1e-3,
        start_ns=start_ns,
        end_ns=end_ns,
        spans=spans,
    )


def produce(
    address: str,
    job_id: str,
    rank: int,
    world_size: int,
    attempt: int,
    first_step: int,
    steps: int,
    busy_seconds: float,
    epoch: float | None = None,
    period: float = 0.1,
) -> None:
    """`steps` steps of one rank of `job_id`, then the end of its run.

    As in synchronous training, the ranks of a world step together: step `first_step + n`
    starts at `epoch + n × period` on every rank given the same epoch (a late rank joins at
    the current step; None: the epoch is when this rank is ready, its first step is
    `first_step`), and takes `busy_seconds` of it on this rank.
    """
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    os.environ["PLAIT_HEARTBEAT_INTERVAL_MS"] = "200"
    plugins = Plugins.create(autoload=False, builtins=())
    plugins.register(make_plugin(), "telemetry")
    plugins.configure(load_config({"telemetry": {"daemon": address}}))
    plugins.job_start(job_info(rank=rank, world_size=world_size, job_id=job_id))
    epoch = time.time() if epoch is None else epoch
    n = 0
    for _ in range(steps):
        n = max(n, math.floor((time.time() - epoch) / period))
        time.sleep(max(0.0, epoch + n * period - time.time()))
        step = first_step + n
        plugins.step_start(step)
        start = time.time_ns()
        time.sleep(busy_seconds)
        plugins.step_end(report(step, start, time.time_ns()))
        n += 1
    plugins.job_end()
