"""Shared fixtures: a fresh plugin manager per test, with entry-point autoload off."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Triton decides between compiling and interpreting when a kernel is decorated, so the switch
# must be set before any test module imports a kernel. Without a GPU, kernels are interpreted.
if not os.environ.get("CUDA_VISIBLE_DEVICES") and not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def plugins():
    from plait.core.plugins import Plugins

    return Plugins.create(autoload=False)
