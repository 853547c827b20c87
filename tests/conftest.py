"""Shared fixtures: a fresh plugin manager per test, with entry-point autoload off."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PLAIT_DISABLE_PLUGIN_AUTOLOAD", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def plugins():
    from plait.core.plugins import Plugins

    return Plugins.create(autoload=False)
