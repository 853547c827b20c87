"""The docs' code runs as written: the `plait.initialize` loop and the `transformers` model
(docs/your-own-model.md), the strategy example (docs/plugins.md), and the layout table
(docs/layout.md) names the plugin folders as they are."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.doc_blocks import page, python_blocks

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, tmp_path: Path) -> str:
    script = tmp_path / "snippet.py"
    script.write_text(code)
    result = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
        env={
            "PLAIT_DISABLE_PLUGIN_AUTOLOAD": "1",
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(tmp_path),
        },
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


SETUP = textwrap.dedent(
    """
    import torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32))
    tokens = (torch.arange(17).repeat(8, 1) + torch.arange(8)[:, None]) % 32
    my_loader = [(tokens[:, :-1], tokens[:, 1:])] * 20
    """
)


@pytest.mark.timeout(150)
def test_initialize_snippet_trains(tmp_path: Path) -> None:
    snippet = next(b for b in python_blocks(page("your-own-model.md")) if "my_loader" in b)
    code = SETUP + snippet + "\nprint('first', engine.global_step, 'loss', loss)\n"
    code = code.replace(
        "for inputs, targets in my_loader:", "losses = []\nfor inputs, targets in my_loader:"
    )
    code = code.replace(
        "loss = engine.train_step((inputs, targets))",
        "loss = engine.train_step((inputs, targets)); losses.append(loss)",
    )
    code += "\nassert losses[-1] < losses[0] - 0.05, losses\nprint('ok')\n"
    assert _run(code, tmp_path).strip().endswith("ok")


@pytest.mark.timeout(150)
def test_plugin_example_is_a_working_strategy(tmp_path: Path) -> None:
    plugin = next(b for b in python_blocks(page("plugins.md")) if "class MyRuntime" in b)
    package = tmp_path / "my_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_dp.py").write_text(plugin)
    code = SETUP + textwrap.dedent(
        """
        import plait
        from plait.core.plugins import Plugins
        import my_package.my_dp as my_dp

        plugins = Plugins.create(autoload=False, extra=[("my_dp", my_dp)])
        engine = plait.initialize(
            model, config={"parallel": {"dp_strategy": "my_dp"}, "telemetry": {"enabled": False}},
            plugins=plugins,
        )
        assert type(engine.runtimes[0]).__name__ == "MyRuntime"
        losses = [engine.train_step(batch) for batch in my_loader[:5]]
        assert losses[-1] < losses[0], losses
        print("ok")
        """
    )
    assert _run(code, tmp_path).strip().endswith("ok")


@pytest.mark.timeout(150)
def test_your_own_model_snippet_trains_a_transformers_model(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    blocks = python_blocks(page("your-own-model.md"))
    snippet = next(b for b in blocks if b.startswith("# your_own_model.py"))
    out = _run(snippet.replace('"zero3"', '"zero3"}, "telemetry": {"enabled": False'), tmp_path)
    assert "trained 6 steps" in out, out


def test_the_layout_names_every_plugin_folder_and_no_other() -> None:
    """The layout page's `plugins/` row follows the folders as they are."""
    layout = page("layout.md")
    (row,) = [line for line in layout.splitlines() if line.startswith("| `plugins/` |")]
    named = set(re.findall(r"`([a-z_0-9]+)/`", row.split("|")[3]))
    folders = {p.parent.name for p in (ROOT / "plugins").glob("*/__init__.py")}
    assert named == folders, (
        f"docs/layout.md lacks {sorted(folders - named)}, names missing {sorted(named - folders)}"
    )
