"""`plait calibrate`: measure this host's CPU peak FLOP/s once and cache it for every rank.

Ranks on CPU divide model FLOP/s by this figure (`plait.daemon.peak_flops`). Run it on an idle
host; ranks that find no cached figure measure it themselves (the first rank of the host, under
a file lock, while the others wait), and `plait daemon` measures it at start.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console

from plait.training.output import make_console

if TYPE_CHECKING:
    from plait.daemon.peak_flops import CpuCalibration

app = typer.Typer()


def report_calibration(console: Console, *, force: bool = False) -> None:
    """Load or measure this host's calibration and print the figure and where it lives."""
    from plait.daemon.peak_flops import host_cpu_calibration, ranks_on_this_host

    calibration, path = host_cpu_calibration(force=force)
    probes = ", ".join(f"{k} {v / 1e9:,.1f}" for k, v in calibration.probe_flops.items())
    console.print(
        f"CPU peak {calibration.flops / 1e9:,.1f} GFLOP/s ({calibration.dtype} GEMM "
        f"{calibration.gemm_size}², {calibration.cores} cores at once, "
        f"{calibration.cpu_model}); per rank with {ranks_on_this_host()} rank(s) on this host: "
        f"{calibration.per_rank(ranks_on_this_host()).flops / 1e9:,.1f} GFLOP/s\n"
        f"probe GFLOP/s: {probes} · measured by {calibration.measured_by} · {_share(calibration)}"
        f" · cached in {path}",
        highlight=False,
        markup=False,
    )


def _share(calibration: CpuCalibration) -> str:
    share = calibration.cpu_share
    if calibration.settled:
        return f"the GEMM had the cores ({share:.0%} of their time)"
    shown = "unknown" if share is None else f"{share:.0%}"
    return f"the GEMM shared the cores ({shown} of their time): measured again once an hour old"


@app.command()
def calibrate(
    force: Annotated[
        bool, typer.Option("--force", help="measure again even if a figure is cached")
    ] = False,
) -> None:
    """Measure this host's CPU peak FLOP/s (all cores, fastest dtype) and cache it."""
    report_calibration(make_console(), force=force)
