"""The mark of tests that run Triton kernels on CPU tensors, through the interpreter.

Triton chooses between compiling and interpreting when a kernel is decorated, so
`TRITON_INTERPRET=1` must be set before the kernel modules are imported: `tests/conftest.py` sets
it where there is no CUDA device. Where there is one it stays off, these tests skip, and the
GPU tier (`tests/gpu`, `make test-gpu`) runs the kernels compiled instead.
"""

from __future__ import annotations

import os

import pytest

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
interpreted_only = pytest.mark.skipif(
    not INTERPRETING,
    reason="Triton kernels are interpreted only with TRITON_INTERPRET=1 set before they are "
    "imported (tests/conftest.py sets it without CUDA); on a GPU, make test-gpu compiles them",
)
