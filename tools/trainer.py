"""The worker torchrun starts on every rank for `plait train`:

    python -m plait.tools.trainer CONFIG [--set k=v ...]

It loads the config, runs the training loop (`plait.training.loop.run_training`) and turns an
error into torchrun's report (the launcher prints the root cause once, from the rank's error
file) and an exit status: 0 done, 2 a plait error (a bad config, a refused layout), 1 other.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from plait.core.config import load_config
from plait.core.errors import PlaitError
from plait.training.launch_errors import record_rank_error
from plait.training.loop import run_training


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="plait-trainer")
    parser.add_argument("config")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, args.overrides)
        run_training(config)
    except PlaitError as exc:
        # Under torchrun the launcher prints the root cause once, from the rank's error file.
        if not record_rank_error(exc, os.environ):
            print(f"rank {os.environ.get('RANK', '0')}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:
        if not record_rank_error(exc, os.environ):
            raise
        return 1
    finally:
        _release_process_group()
    return 0


def _release_process_group() -> None:
    """Tear the process group down before the interpreter exits: a rank leaving with it alive
    (after an error) aborts in C++ ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
