"""`transformers` models through `plait.initialize`, unwrapped, against the user's plain loop.

Llama (GQA) and GPT-2 (tied embeddings, fused `Conv1D` q | k | v) from tiny configs compute their
own loss from `labels`; every layout (data, tensor and pipeline parallel) runs 5 steps on 2 Gloo
ranks and must give the plain single-process loop's losses and gradient norms (fp32: only the
summation order differs), and the parameters reassembled from what the ranks declare they hold
(a checkpoint's view) must be the plain loop's after those steps (AdamW turns summation-order
noise in tiny gradients into differences of a few 1e-5).
"""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import hf_workers

pytest.importorskip("transformers")

TOL = 1e-5
PARAMETER_TOL = 2e-4

COMMON = {
    "ddp": {"parallel": {"dp_strategy": "ddp"}},
    "zero1": {"parallel": {"dp_strategy": "zero1"}},
    "zero2_accumulate": {"parallel": {"dp_strategy": "zero2"}, "train": {"micro_batch_size": 2}},
    "zero3": {"parallel": {"dp_strategy": "zero3"}},
}
# Two pipeline stages (embeddings + block 0 | block 1 + norm + head), four micro-batches each;
# GPT-2's tied embedding and head land on different ranks.
PIPELINE = {
    "pp2_1f1b": {
        "parallel": {"pp": 2},
        "schedule": {"name": "1f1b"},
        "train": {"micro_batch_size": 2},
    },
    "pp2_gpipe": {
        "parallel": {"pp": 2},
        "schedule": {"name": "gpipe"},
        "train": {"micro_batch_size": 2},
    },
}
TENSOR_PARALLEL = {
    "tp2": {"parallel": {"tp": 2}},
    "tp2_sequence_parallel": {"parallel": {"tp": 2}, "tp": {"sequence_parallel": True}},
}


@pytest.mark.dist
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_layouts_match_the_plain_loop(family: str) -> None:
    layouts = {**COMMON, **PIPELINE, **TENSOR_PARALLEL}
    ranks = run_distributed(hf_workers.train_layouts, 2, family, layouts, timeout=360)
    for results in ranks:
        reference = results["reference"]
        for name in layouts:
            got = results[name]["losses"]
            assert got == pytest.approx(reference, abs=TOL, rel=TOL), (family, name, got, reference)
            norms, expected = results[name]["grad_norms"], results["reference_grad_norms"]
            assert norms == pytest.approx(expected, rel=1e-4), (family, name, norms, expected)
            assert results[name]["flops_per_token"] > 0, (family, name)
            difference = results[name]["parameter_difference"]
            assert difference <= PARAMETER_TOL, (family, name, difference)
