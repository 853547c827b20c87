"""Checks before any rank starts: what can be known from the config, the launch and the model.

`plait config validate` and `plait train` run these once, so a layout that cannot work is one
message in a second instead of an error per rank after the ranks have started: degrees against
the number of ranks, the divisibility of heads, key/value heads, layers and vocabulary by the
degrees that split them, and data paths.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from plait.core.config import PlaitConfig
from plait.core.errors import ConfigError, MeshError
from plait.core.parallel_dims import resolve_degrees


def check_launch(config: PlaitConfig, *, world_size: int, model_config: Any = None) -> None:
    """Raise one error listing every problem the config has on `world_size` ranks."""
    problems: list[str] = []
    par = config.parallel
    try:
        degrees = resolve_degrees(world_size, dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    except MeshError as exc:
        problems.append(f"{exc} (launching {world_size} ranks: --nproc-per-node × --nnodes)")
        degrees = {"pp": par.pp, "dp": max(par.dp, 1), "cp": par.cp, "tp": par.tp}
    if model_config is not None:
        problems += _model_fits(config, degrees, model_config)
    if config.data.path and not Path(config.data.path).expanduser().is_dir():
        problems.append(
            f"data.path = {config.data.path!r} is not a directory (prepare one with "
            "`plait data prepare`, or leave it empty for the bundled corpus)"
        )
    problems += validation_data_problems(config)
    batch_share = config.train.global_batch_size % degrees["dp"]
    if batch_share:
        problems.append(
            f"train.global_batch_size = {config.train.global_batch_size} is not divisible by "
            f"dp = {degrees['dp']}"
        )
    if problems:
        raise ConfigError("the job cannot start:\n  " + "\n  ".join(problems))


def validation_data_problems(config: PlaitConfig) -> list[str]:
    """`data.validation_path` that nothing would read, or that is no prepared directory."""
    path = config.data.validation_path
    if not path:
        return []
    if not config.train.eval_every:
        return [
            f"data.validation_path = {path!r} is read only by validation, but train.eval_every "
            "= 0; set train.eval_every (e.g. 50), or leave data.validation_path empty"
        ]
    if not Path(path).expanduser().is_dir():
        return [
            f"data.validation_path = {path!r} is not a directory (prepare one with "
            "`plait data prepare`)"
        ]
    return []


def _model_fits(config: PlaitConfig, degrees: dict[str, int], model: Any) -> list[str]:
    """Head, layer and vocabulary counts against the degrees that split them."""
    problems = []
    tp, pp, cp = degrees["tp"], degrees["pp"], degrees["cp"]
    heads = getattr(model, "n_heads", None)
    kv_heads = getattr(model, "n_kv_heads", None) or heads
    layers = getattr(model, "n_layers", None)
    vocab = getattr(model, "vocab_size", None)
    if isinstance(heads, int) and heads % tp:
        problems.append(f"parallel.tp = {tp} does not divide the model's {heads} attention heads")
    if isinstance(kv_heads, int) and kv_heads % tp and tp % kv_heads:
        problems.append(
            f"parallel.tp = {tp} neither divides nor is a multiple of the model's {kv_heads} "
            "key/value heads"
        )
    if isinstance(vocab, int) and vocab % tp:
        problems.append(f"parallel.tp = {tp} does not divide the vocabulary ({vocab})")
    chunks = pp * config.schedule.virtual_stages
    if isinstance(layers, int) and pp > 1 and layers < chunks:
        problems.append(
            f"parallel.pp = {pp} × schedule.virtual_stages = {config.schedule.virtual_stages} "
            f"needs at least {chunks} layers; the model has {layers}"
        )
    seq_len = config.data.seq_len
    if cp > 1 and seq_len % (2 * cp):
        problems.append(
            f"data.seq_len = {seq_len} is not divisible by 2 × parallel.cp = {2 * cp} (the "
            "load-balanced context-parallel split)"
        )
    return problems
