"""A strategy written outside plait is checkpointed, resumed and resharded through the state
layout it declares, with no knowledge of it in the checkpointer.

`rowdp` (defined here, registered in code) is data parallelism that keeps, for every 2-D
parameter, only this rank's block of rows of the Adam state: it all-reduces gradients, steps
its rows, and all-gathers them. Its runtime declares that layout with `state_layout()` (the
first moment as a tensor view, the second through getter/setter callables). On 2 Gloo ranks it
trains, saves, resumes with the losses of an uninterrupted run, and its checkpoint loads into
DDP and ZeRO-1 with equal parameters and continuing losses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from plait.core.engine import Engine
from plait.core.plugins import Plugins
from plait.core.sharding import OptimizerFactory, ParallelRuntime, ShardContext, Sharded
from plait.core.state_layout import (
    LocalPiece,
    ParameterLayout,
    Region,
    StateLayout,
    StepCount,
    TensorLayout,
    set_step_count,
)
from plait.core.strategy import Strategies
from plait.plugins.checkpoint.config import CheckpointIOConfig
from plait.testing.distributed import run_distributed

pytestmark = pytest.mark.dist

STEPS = 4
SAVE_AT = 2
# DDP and ZeRO-1 sum gradients in other orders (buckets): equal up to rounding.
TOL = 1e-5


# -- the third-party strategy ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RowShard:
    """The rows `start:start + rows` of `full` this rank steps; `param` views them."""

    full: nn.Parameter
    param: nn.Parameter
    start: int
    rows: int


class RowShardedDataParallel(ParallelRuntime):
    name = "rowdp"

    def __init__(self, module: nn.Module, context: ShardContext) -> None:
        self.module = module
        self.comm = context.comm
        self.group = context.mesh.group("dp")
        self.rank = self.group.rank_of(context.mesh.rank)
        self.params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            for p in self.params:
                self.comm.broadcast(p.data, src=self.group.ranks[0], group=self.group)
        self.shards: dict[int, RowShard] = {}
        self.optimizer: torch.optim.Optimizer | None = None

    def build_optimizer(
        self, module: nn.Module, factory: OptimizerFactory
    ) -> torch.optim.Optimizer | None:
        del module
        stepped: list[nn.Parameter] = []
        for p in self.params:
            if p.ndim == 2 and p.shape[0] % self.group.size == 0:
                rows = p.shape[0] // self.group.size
                start = self.rank * rows
                shard = nn.Parameter(p.data.narrow(0, start, rows))  # a view of p's rows
                self.shards[id(p)] = RowShard(p, shard, start, rows)
                stepped.append(shard)
            else:
                stepped.append(p)  # vectors: stepped whole, identically on every rank
        self.optimizer = factory(stepped)
        return self.optimizer

    def sync_gradients(self) -> None:
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            self.comm.all_reduce(p.grad, group=self.group, op="avg", purpose="grad")
            shard = self.shards.get(id(p))
            if shard is not None:
                shard.param.grad = p.grad.narrow(0, shard.start, shard.rows)

    def after_optimizer_step(self) -> None:
        for shard in self.shards.values():
            rows = shard.param.detach().clone()  # an all-gather input must not alias its output
            self.comm.all_gather(shard.full.data, rows, group=self.group, purpose="rows")

    def zero_grad(self) -> bool:
        for p in self.params:
            p.grad = None
        for shard in self.shards.values():
            shard.param.grad = None
        return True

    def state_layout(self, previous: StateLayout) -> StateLayout:
        """Weights stay whole and replicated (the default); the Adam state of a row-sharded
        parameter is this rank's rows of the global tensor, sharded over dp."""
        assert self.optimizer is not None
        optimizer = self.optimizer

        def refine(entry: ParameterLayout) -> ParameterLayout:
            shard = self.shards.get(id(entry.param))
            state = optimizer.state.get(shard.param) if shard is not None else None
            if shard is None or not state:
                return entry
            region = Region.whole(entry.value.global_shape).narrow(0, shard.start, shard.rows)

            def rows_of(piece: LocalPiece) -> TensorLayout:
                return TensorLayout(
                    global_shape=entry.value.global_shape, pieces=(piece,), sharded_over=("dp",)
                )

            def set_second_moment(value: torch.Tensor, state: dict[str, Any] = state) -> None:
                state["exp_avg_sq"].copy_(value)

            return replace(
                entry,
                optimizer_state={
                    "exp_avg": rows_of(LocalPiece(region, tensor=state["exp_avg"])),
                    "exp_avg_sq": rows_of(
                        LocalPiece(
                            region,
                            get=lambda state=state: state["exp_avg_sq"],
                            set=set_second_moment,
                        )
                    ),
                },
                step=StepCount(
                    get=lambda state=state: state["step"],
                    set=lambda value, state=state: set_step_count(state, value),
                ),
            )

        return previous.map(refine)


strategies = Strategies()


@strategies.provide(name="rowdp", axis="dp", description="row-sharded Adam state (test)")
def shard_rowdp(model: nn.Module, *, context: ShardContext, config: Any) -> Sharded:
    del config
    return Sharded(module=model, runtime=RowShardedDataParallel(model, context))


# -- rank functions -------------------------------------------------------------------------------


def _config(dp_strategy: str) -> dict[str, Any]:
    from tests.dist.checkpoint_workers import engine_config

    config = engine_config(dp_strategy=dp_strategy)
    config["train"] = {**config["train"], "steps": STEPS}
    return config


def _train(
    dp_strategy: str, ckpt_dir: Path, *, stop: int, save_at: tuple[int, ...] = ()
) -> dict[str, Any]:
    """Train to `stop` steps on `dp_strategy`, resuming from `ckpt_dir` if it holds a checkpoint."""
    from plait.plugins.checkpoint.checkpointer import Checkpointer
    from plait.plugins.data import build_batches

    plugins = Plugins.create(extra=[("rowdp_strategy", strategies)])
    engine = Engine(config=_config(dp_strategy), plugins=plugins)
    batches = build_batches(
        engine.config.data,
        seq_len=engine.config.data.seq_len,
        global_batch_size=engine.config.train.global_batch_size,
        dp_rank=engine.mesh.coordinate("dp"),
        dp_size=engine.mesh.size("dp"),
        seed=engine.config.train.seed,
    )
    resume = any(ckpt_dir.glob("step-*"))
    checkpointer = Checkpointer(
        engine, batches, CheckpointIOConfig(dir=str(ckpt_dir), resume=resume, keep=0)
    )
    start = checkpointer.maybe_resume()
    loaded = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    losses: dict[int, float] = {}
    for step in range(start, stop):
        losses[step] = engine.train_step(batches.next_batch())
        if step + 1 in save_at:
            checkpointer.save(step + 1)
    saved = {name: p.detach().clone() for name, p in engine.module.named_parameters()}
    checkpointer.close()
    engine.close()
    return {
        "start": start,
        "losses": losses,
        "loaded": loaded,
        "final": saved,
        "runtimes": [rt.name for rt in engine.runtimes],
    }


def save_resume_reshard(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every case on one pair of spawned ranks (each case builds its own engine)."""
    del rank, world_size
    base = Path(root)
    return {
        "straight": _train("rowdp", base / "straight", stop=STEPS),
        "first": _train("rowdp", base / "split", stop=SAVE_AT, save_at=(SAVE_AT,)),
        "resumed": _train("rowdp", base / "split", stop=STEPS),
        "ddp": _train("ddp", base / "split", stop=STEPS),
        "zero1": _train("zero1", base / "split", stop=STEPS),
    }


# -- the test -------------------------------------------------------------------------------


def test_third_party_strategy_saves_resumes_and_reshards(tmp_path: Path) -> None:
    from plait.plugins.checkpoint.offline import read_checkpoint

    ranks = run_distributed(save_resume_reshard, 2, str(tmp_path), timeout=240)
    for result in ranks:
        straight, first, resumed = result["straight"], result["first"], result["resumed"]
        assert "rowdp" in straight["runtimes"]
        # Same layout: bit-exact continuation of the uninterrupted run.
        assert resumed["start"] == SAVE_AT
        assert {**first["losses"], **resumed["losses"]} == straight["losses"]
        # Other layouts: the weights the row-sharded job saved, and the losses it went on with
        # (which need its sharded Adam state, carried over to whole and flat-shard layouts).
        for other in ("ddp", "zero1"):
            run = result[other]
            assert other in run["runtimes"] and run["start"] == SAVE_AT
            for name, value in first["final"].items():
                assert torch.equal(run["loaded"][name], value), f"{other}: {name} differs"
            for step in range(SAVE_AT, STEPS):
                torch.testing.assert_close(
                    run["losses"][step], straight["losses"][step], rtol=TOL, atol=TOL,
                    msg=lambda m, o=other, s=step: f"{o} step {s}: {m}",
                )  # fmt: skip

    # The checkpoint holds each sharded moment whole, every rank's rows written.
    state = read_checkpoint(tmp_path / "split", prefix="optim.layers.0.attention.wq.weight.")
    weight = ranks[0]["first"]["final"]["layers.0.attention.wq.weight"]
    for key in ("exp_avg", "exp_avg_sq"):
        moment = state[f"optim.layers.0.attention.wq.weight.{key}"]
        assert moment.shape == weight.shape
        half = weight.shape[0] // 2
        assert moment[:half].abs().sum() > 0 and moment[half:].abs().sum() > 0
