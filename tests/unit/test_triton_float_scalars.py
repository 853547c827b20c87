"""The attention kernels compile for a Hopper GPU when their scale arrives as float64, on a CPU.

Under `torch.compile`, a scale derived from a symbolic head size reaches the kernel as a float64
scalar; before the kernels cast it, every score and the loop-carried running max became
float64 and Triton refused the kernel ("Loop-carried variable running_max has initial type
fp32 but is re-assigned to fp64"), which failed every compiled layout with Triton kernels on an
H200. Triton's front end runs without a GPU: each kernel is compiled for `cuda:90` here, in a
process of its own with the interpreter off (the suite interprets kernels, and an interpreted
helper cannot be called from a compiled kernel).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

KERNELS = ("_attn_fwd", "_attn_bwd_dq", "_attn_bwd_dkdv")
COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.errors import CompilationError
from plait.plugins.kernels_triton import attention

CONSTEXPRS = {"CAUSAL": True, "DOCUMENTS": False, "COUNT_VISITS": False, "BLOCK_M": 64,
              "BLOCK_N": 64, "BLOCK_D": 64, "EVEN_D": True, "PRECISION": "ieee"}
found = {}
for name in sys.argv[1:]:
    kernel = getattr(attention, name)
    signature, constexprs = {}, {}
    for index, arg in enumerate(kernel.arg_names):
        if arg in CONSTEXPRS:
            signature[arg], constexprs[(index,)] = "constexpr", CONSTEXPRS[arg]
        elif arg.endswith("_ptr"):
            signature[arg] = "*fp32" if arg in ("lse_ptr", "delta_ptr") else "*bf16"
        else:
            signature[arg] = "fp64" if arg in ("qk_scale", "sm_scale") else "i32"
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    try:
        triton.compile(source, target=GPUTarget("cuda", 90, 32))
        found[name] = "compiled"
    except CompilationError as error:
        found[name] = "refused: " + str(error)[-400:]
    except Exception as error:  # the CUDA back end's tools missing from this Triton install
        found[name] = f"unavailable: {type(error).__name__}: {error}"[:400]
print("RESULT " + json.dumps(found))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, str]:
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run(
        [sys.executable, "-c", COMPILE, *KERNELS],
        capture_output=True, text=True, env=env, timeout=240, check=True,
    )  # fmt: skip
    (line,) = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.mark.parametrize("kernel", KERNELS)
def test_attention_kernels_take_a_float64_scale(kernel: str, compiled: dict[str, str]) -> None:
    outcome = compiled[kernel]
    if outcome.startswith("unavailable"):
        pytest.skip(f"Triton cannot compile for cuda:90 here: {outcome}")
    assert outcome == "compiled", f"{kernel} with a float64 scale: {outcome}"
