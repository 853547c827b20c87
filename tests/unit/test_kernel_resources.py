"""The norm and cross-entropy kernels compile for Hopper on a CPU at the 1B Llama's shapes, at
every warps their tuners may choose, and keep their rows in registers (no spills): the census of
`tools/bench/kernel_resources.py`, run in a process of its own with the interpreter off (the
suite interprets kernels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

CENSUS = r"""
import json
from plait.tools.bench.kernel_resources import census
from dataclasses import asdict
print("RESULT " + json.dumps([asdict(row) for row in census(["norms", "cross_entropy"], 90)]))
"""


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", CENSUS], capture_output=True, text=True, env=env, timeout=300,
        check=True,
    )  # fmt: skip
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


def test_every_norm_and_cross_entropy_variant_compiles_for_hopper_without_spilling(
    rows: list[dict],
) -> None:
    if any(row["outcome"].startswith("unavailable") for row in rows):
        pytest.skip(f"Triton cannot compile for cuda:90 here: {rows[0]['outcome']}")
    kernels = {row["kernel"] for row in rows}
    assert kernels == {"_rms_norm_fwd", "_rms_norm_bwd", "_layer_norm_fwd", "_layer_norm_bwd",
                       "_cross_entropy_fwd", "_cross_entropy_bwd"}  # fmt: skip
    # Hidden 2048: the Apex/Liger 8 warps and its neighbours 4 and 16, forward and backward;
    # the cross-entropy's tuner tries 4, 8 and 16 too.
    for kernel in ("_rms_norm_bwd", "_cross_entropy_fwd", "_cross_entropy_bwd"):
        assert {row["warps"] for row in rows if row["kernel"] == kernel} == {4, 8, 16}
    for row in rows:
        assert row["outcome"] == "compiled", row
        if row["registers"] is not None:  # read from the cubin where cuobjdump is shipped
            assert row["stack_bytes"] == 0, f"{row['kernel']} spills: {row}"
            assert 0 < row["registers"] <= 255
