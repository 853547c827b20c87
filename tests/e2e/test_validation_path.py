"""`data.validation_path`: a prepared directory of its own for the validation loss (e.g. the
held-out conversations), in place of the held-out end of `data.path`.

Run through `run_training` in one process, as `plait train` runs each rank: the training steps
are exactly those of a run without validation (nothing of `data.path` is held out), the loss
reported every `train.eval_every` steps is computed on the directory named (another directory
gives another figure), and a path nothing would read, or that is not there, is refused by name.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from plait.core.config import load_config
from plait.core.errors import ConfigError
from plait.tools.cli import app
from plait.training.loop import TrainingSummary, run_training

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
SETTINGS = [
    "data.seq_len=32",
    "data.packing=concat_split",
    "model.overrides.vocab_size=257",
    f"train.steps={STEPS}",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.eval_batches=1",
    "telemetry.enabled=false",
]


def _prepare(tmp_path: Path, name: str, words: list[str], seed: int) -> str:
    rng = np.random.default_rng(seed)
    rows = [
        json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(5, 60))))})
        for _ in range(80)
    ]
    (tmp_path / f"{name}.jsonl").write_text("\n".join(rows) + "\n", encoding="utf-8")
    out = tmp_path / name
    result = CliRunner().invoke(
        app, ["data", "prepare", str(tmp_path / f"{name}.jsonl"), "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    return str(out)


def _train(*overrides: str) -> TrainingSummary:
    console = Console(file=io.StringIO(), width=200, force_terminal=False)
    config = load_config(ROOT / "configs/tiny.toml", [*SETTINGS, *overrides])
    return run_training(config, console=console)


@pytest.mark.timeout(300)
def test_validation_reads_its_own_directory_and_holds_nothing_out(tmp_path: Path) -> None:
    grammar = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "."]
    train = _prepare(tmp_path, "train", grammar, seed=1)
    near = _prepare(tmp_path, "near", grammar, seed=2)
    far = _prepare(tmp_path, "far", ["zebra", "quartz", "jumps", "vex", "fjord", "?"], seed=3)

    plain = _train(f"data.path={train}")
    with_near = _train(f"data.path={train}", f"data.validation_path={near}", "train.eval_every=4")
    with_far = _train(f"data.path={train}", f"data.validation_path={far}", "train.eval_every=4")
    held_out = _train(f"data.path={train}", "train.eval_every=4", "train.eval_fraction=0.3")

    # Nothing of data.path is held out: the same steps, to the bit, as without validation ...
    assert with_near.losses == plain.losses == with_far.losses
    # ... which a held-out split of data.path would change.
    assert held_out.losses != plain.losses
    assert sorted(with_near.val_losses) == sorted(with_far.val_losses) == [4, 8]
    # The figure is the named directory's: text of the training grammar scores far better than
    # words the model never saw.
    assert with_near.val_losses[STEPS] < with_far.val_losses[STEPS] - 0.5, (
        with_near.val_losses,
        with_far.val_losses,
    )


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (("data.validation_path={dir}",), r"data.validation_path = .* train.eval_every = 0"),
        (
            ("data.validation_path={dir}/missing", "train.eval_every=2"),
            r"data.validation_path = .*missing' is not a directory",
        ),
    ],
)
def test_a_validation_path_that_cannot_be_used_is_refused_by_name(
    tmp_path: Path, overrides: tuple[str, ...], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        _train(*(o.format(dir=tmp_path) for o in overrides))
