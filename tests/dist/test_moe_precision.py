"""fp16 dynamic loss scaling reaches the MoE balancing losses: their gradient (added inside
backward by `inject_loss`) is multiplied by the loss scale like the main loss's, so after the
scaler divides it out the router's gradient matches the fp32 run. A balancing coefficient large
enough that the auxiliary loss dominates the router's gradient makes a missing scale obvious."""

from __future__ import annotations

from typing import Any

import pytest

from plait.testing.distributed import run_distributed
from tests.dist.moe_workers import router_gradients

pytestmark = pytest.mark.dist


def _config(precision: dict[str, Any] | None, micro_batch: int) -> dict[str, Any]:
    transforms = {"ep": "ep"} | ({"precision": "amp"} if precision else {})
    return {
        "model": {
            "name": "moe",
            "size": "tiny",
            "overrides": {"aux_loss_coef": 10.0, "z_loss_coef": 0.1},
        },
        "data": {"seq_len": 16},
        "train": {"global_batch_size": 4, "micro_batch_size": micro_batch},
        "parallel": {"transforms": transforms},
        **({"amp": precision} if precision else {}),
    }


FP16 = {"dtype": "fp16", "initial_scale": 2.0**12}
CASES = {
    "fp32": _config(None, 4),
    "fp16": _config(FP16, 4),
    "fp32-2mb": _config(None, 2),
    "fp16-2mb": _config(FP16, 2),
}
# fp16 rounding of activations and parameters; a missing loss scale leaves ~1e-4 of the
# balancing gradient, a relative error of ~1.
RELATIVE_TOLERANCE = 0.05


@pytest.fixture(scope="module")
def gradients() -> dict[str, dict[str, Any]]:
    return run_distributed(router_gradients, 1, CASES, timeout=240)[0]


@pytest.mark.parametrize("suffix", ["", "-2mb"])
def test_fp16_router_gradients_match_fp32(
    suffix: str, gradients: dict[str, dict[str, Any]]
) -> None:
    fp32, fp16 = gradients[f"fp32{suffix}"], gradients[f"fp16{suffix}"]
    assert fp32 and fp32.keys() == fp16.keys()
    for name, expected in fp32.items():
        error = (fp16[name] - expected).norm() / expected.norm()
        assert error < RELATIVE_TOLERANCE, f"{name}: relative error {error:.3g}"
