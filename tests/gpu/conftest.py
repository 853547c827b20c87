"""The GPU tier: what only a CUDA device can check. `make test-gpu` runs it with Triton compiling
its kernels (no interpreter). Every test here is marked `cuda` and skipped, with the reason,
where there is no CUDA device or the Triton interpreter is on in this process — so `make test`
stays green on a CPU machine and says what it did not run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def why_not_here() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: the GPU tier runs with `make test-gpu` on a GPU machine"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 in this process: the GPU tier compiles kernels (make test-gpu)"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    del config
    reason = None
    for item in items:
        if HERE not in Path(str(item.fspath)).resolve().parents:
            continue
        item.add_marker(pytest.mark.cuda)
        reason = reason or why_not_here() or ""
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(autouse=True, scope="session")
def _own_cache_and_default_tiles(tmp_path_factory: pytest.TempPathFactory):
    """Caches go to a directory of the test run's own, not the user's `~/.cache/plait`; and the
    Triton kernels keep their default tiles (timing every candidate of every shape would
    compile each of them), except where a test tunes on purpose (`tuning(bench=…)`)."""
    settings = {
        "PLAIT_CACHE_DIR": str(tmp_path_factory.mktemp("plait-cache")),
        "PLAIT_TRITON_AUTOTUNE": "0",
    }
    previous = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    yield
    for name, value in previous.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
