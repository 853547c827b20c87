"""Where the e2e tests put the hold plugin (`tests/e2e/ft_hold_plugin.py`) so `plait train`'s
ranks find it through the `plait` entry-point group, as a third party's plugin is found: a
dist-info folder on `PYTHONPATH`, and the environment the CLI is run with."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def install_hold_plugin(site: Path) -> Path:
    """Write the hold plugin's dist-info under `site`; returns `site`."""
    info = site / "plait_ft_hold_plugin-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: plait-ft-hold-plugin\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text("[plait]\nft_hold = tests.e2e.ft_hold_plugin:plugin\n")
    return site


def plugin_env(site: list[Path], **extra: str) -> dict[str, str]:
    """This process's environment with plugin autoload on, the hold plugin's site and the
    repository on `PYTHONPATH`, a wide terminal and one thread per rank, then `extra`."""
    env = {k: v for k, v in os.environ.items() if k != "PLAIT_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join(map(str, [*site, ROOT]))
    env.update(COLUMNS="250", OMP_NUM_THREADS="1", **extra)
    return env
