"""What plait's Triton kernels cost on an NVIDIA chip, read from their machine code, on a CPU.

    python tools/bench/kernel_resources.py [--arch 90] [--only norms,cross_entropy] [--json F]

Triton's front end and the CUDA back end (ptxas, cuobjdump, shipped in Triton's wheel) run
without a GPU. Each kernel is compiled for `--arch` (default sm_90, Hopper) at the 1B Llama's
shapes, once per tile the tuner may choose, the way a launch on aligned tensors specializes it
(pointers and strides divisible by 16), and the table gives what the machine code holds:
registers per thread, stack bytes (spilled registers), shared memory, tensor-core instructions
(HGMMA / HMMA) and asynchronous copies (LDGSTS, UTMALDG: the loads the software pipeline
overlaps with compute). No timing: a kernel change that spills, or whose loads stop being
pipelined, shows here before a GPU is at hand; how fast it runs needs the GPU
(`tools/bench/kernels.py`).

Run it with `TRITON_INTERPRET` unset or 0: under the interpreter kernels are never compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Pointer element types by argument name; every other pointer is the activations' bf16.
FP32_POINTERS = {"rstd_ptr", "mean_ptr", "lse_ptr", "delta_ptr", "losses_ptr", "scale_ptr",
                 "dw_partial_ptr", "db_partial_ptr"}  # fmt: skip
INT_POINTERS = {"targets_ptr": "*i64", "q_doc_ptr": "*i32", "k_doc_ptr": "*i32",
                "key_lo_ptr": "*i32", "key_hi_ptr": "*i32", "query_lo_ptr": "*i32",
                "query_hi_ptr": "*i32", "visits_ptr": "*i32"}  # fmt: skip
FLOAT_SCALARS = {"eps", "qk_scale", "sm_scale"}
# Integer scalars a launch on real shapes sees as multiples of 16 (Triton specializes them).
ALIGNED_SCALARS = re.compile(r"^stride_|^(n_cols|vocab|seq_q|seq_k|head_dim)$")
DOCUMENT_POINTERS = ("q_doc_ptr", "k_doc_ptr", "key_lo_ptr", "key_hi_ptr", "query_lo_ptr",
                     "query_hi_ptr", "visits_ptr")  # fmt: skip

LLAMA_1B_HIDDEN = 2048
LLAMA_1B_HEAD_DIM = 64


@dataclass(frozen=True, slots=True)
class KernelCase:
    """One kernel, its compile-time constants and launch options: one compiled variant."""

    family: str
    kernel: Any  # a triton JITFunction
    constants: dict[str, Any]
    num_warps: int
    num_stages: int
    label: str = ""

    @property
    def name(self) -> str:
        return self.kernel.fn.__name__


@dataclass(slots=True)
class Resources:
    family: str
    kernel: str
    label: str
    warps: int
    stages: int
    outcome: str = "compiled"  # or "refused: …" / "unavailable: …"
    registers: int | None = None
    stack_bytes: int | None = None
    shared_bytes: int | None = None
    tensor_core_ops: int | None = None
    async_copies: int | None = None


def _signature(case: KernelCase) -> tuple[dict[str, str], dict[tuple[int], Any], dict]:
    signature: dict[str, str] = {}
    constexprs: dict[tuple[int], Any] = {}
    attrs: dict[tuple[int], list[list[Any]]] = {}
    for index, arg in enumerate(case.kernel.arg_names):
        if arg in case.constants:
            signature[arg], constexprs[(index,)] = "constexpr", case.constants[arg]
            continue
        if arg.endswith("_ptr"):
            signature[arg] = INT_POINTERS.get(arg, "*fp32" if arg in FP32_POINTERS else "*bf16")
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif arg in FLOAT_SCALARS:
            signature[arg] = "fp32"
        else:
            signature[arg] = "i32"
            if ALIGNED_SCALARS.search(arg):
                attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _cuobjdump() -> Path | None:
    import triton

    found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return found if found.exists() else None


def measure(case: KernelCase, arch: int) -> Resources:
    """Compile `case` for sm_`arch` and read its resources from the cubin."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.errors import CompilationError

    found = Resources(case.family, case.name, case.label, case.num_warps, case.num_stages)
    signature, constexprs, attrs = _signature(case)
    source = ASTSource(fn=case.kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    options = {"num_warps": case.num_warps, "num_stages": case.num_stages}
    try:
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)
    except CompilationError as error:
        found.outcome = "refused: " + str(error)[-300:]
        return found
    except Exception as error:  # the CUDA back end's tools missing from this Triton install
        found.outcome = f"unavailable: {type(error).__name__}: {error}"[:300]
        return found
    cuobjdump = _cuobjdump()
    if cuobjdump is None:
        found.outcome = "compiled (no cuobjdump to read the cubin)"
        return found
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / f"{case.name}.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = _run(cuobjdump, "-res-usage", cubin)
        sass = _run(cuobjdump, "-sass", cubin)
    numbers = dict(re.findall(r"(REG|STACK|SHARED):(\d+)", usage))
    found.registers = int(numbers.get("REG", 0))
    found.stack_bytes = int(numbers.get("STACK", 0))
    found.shared_bytes = int(numbers.get("SHARED", 0))
    found.tensor_core_ops = len(re.findall(r"\b(?:HGMMA|HMMA)\b", sass))
    found.async_copies = len(re.findall(r"\b(?:LDGSTS|UTMALDG)\b", sass))
    return found


def _run(tool: Path, flag: str, cubin: Path) -> str:
    return subprocess.run(
        [str(tool), flag, str(cubin)], capture_output=True, text=True, check=True, timeout=120
    ).stdout


def norm_cases(hidden: int = LLAMA_1B_HIDDEN) -> Iterator[KernelCase]:
    """RMSNorm and LayerNorm, forward and backward, at every warps their tuner tries."""
    import triton

    from plait.plugins.kernels_triton import norms

    block = triton.next_power_of_2(hidden)
    for backward in (False, True):
        tiles, _ = norms._row_candidates(block, backward)
        for warps in sorted({t.num_warps for t in tiles}):
            stages = tiles[0].num_stages
            if backward:
                kernels = [(norms._rms_norm_bwd, {}), (norms._layer_norm_bwd, {"HAS_BIAS": True})]
            else:
                kernels = [(norms._rms_norm_fwd, {}), (norms._layer_norm_fwd, {"HAS_BIAS": True})]
            for kernel, extra in kernels:
                yield KernelCase("norms", kernel, {"BLOCK": block, **extra}, warps, stages,
                                 f"hidden {hidden}")  # fmt: skip


def cross_entropy_cases() -> Iterator[KernelCase]:
    from plait.plugins.kernels_triton import cross_entropy

    block = cross_entropy.DEFAULT_VOCAB_BLOCK
    tuned = ((cross_entropy._cross_entropy_fwd, cross_entropy.FORWARD_TILES),
             (cross_entropy._cross_entropy_bwd, cross_entropy.BACKWARD_TILES))  # fmt: skip
    for kernel, tuner in tuned:
        for chosen in tuner.candidates:
            yield KernelCase("cross_entropy", kernel, {"BLOCK_V": block}, chosen.num_warps,
                             chosen.num_stages, f"block {block}")  # fmt: skip


def attention_cases(head_dim: int = LLAMA_1B_HEAD_DIM) -> Iterator[KernelCase]:
    """The three attention kernels, causal, no documents, at every tile of their tuners."""
    from plait.plugins.kernels_triton import attention

    tuners = ((attention._attn_fwd, attention.FORWARD_TILES),
              (attention._attn_bwd_dq, attention.DQ_TILES),
              (attention._attn_bwd_dkdv, attention.DKDV_TILES))  # fmt: skip
    block_d = attention._head_block(head_dim)
    for kernel, tuner in tuners:
        for chosen in tuner.candidates:
            constants = {"CAUSAL": True, "DOCUMENTS": False, "COUNT_VISITS": False,
                         "BLOCK_D": block_d, "EVEN_D": head_dim == block_d, "PRECISION": "tf32",
                         **dict(chosen.blocks), **dict.fromkeys(DOCUMENT_POINTERS)}  # fmt: skip
            constants = {k: v for k, v in constants.items() if k in kernel.arg_names}
            label = f"d {head_dim} " + " ".join(f"{k}={v}" for k, v in chosen.blocks)
            yield KernelCase("attention", kernel, constants, chosen.num_warps, chosen.num_stages,
                             label)  # fmt: skip


FAMILIES = {"norms": norm_cases, "cross_entropy": cross_entropy_cases,
            "attention": attention_cases}  # fmt: skip


def census(families: Sequence[str], arch: int) -> list[Resources]:
    return [measure(case, arch) for family in families for case in FAMILIES[family]()]


def render(rows: Sequence[Resources], arch: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"plait's Triton kernels compiled for sm_{arch} (no GPU needed)")
    columns = ("kernel", "variant", "warps", "stages", "registers", "stack B", "shared B",
               "tensor-core ops", "async copies", "outcome")  # fmt: skip
    for column in columns:
        table.add_column(column)
    for r in rows:
        values = (r.registers, r.stack_bytes, r.shared_bytes, r.tensor_core_ops, r.async_copies)
        table.add_row(r.kernel.lstrip("_"), r.label, str(r.warps), str(r.stages),
                      *("" if v is None else str(v) for v in values), r.outcome)  # fmt: skip
    Console(width=200).print(table)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90, 80")
    parser.add_argument("--only", default="", help=f"comma-separated of {sorted(FAMILIES)}")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        parser.error("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it")
    families = [name for name in args.only.split(",") if name] or list(FAMILIES)
    unknown = set(families) - set(FAMILIES)
    if unknown:
        parser.error(f"unknown kernel families {sorted(unknown)}; known: {sorted(FAMILIES)}")
    rows = census(families, args.arch)
    render(rows, args.arch)
    if args.json is not None:
        args.json.write_text(json.dumps([asdict(row) for row in rows], indent=1))
    return 0 if all(row.outcome.startswith("compiled") for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
