"""A MoE model's expert load, from the router on the rank to the daemon's per-layer figures."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from plait.core.names import normalised_name
from plait.core.plugins import Plugins
from plait.daemon.bottleneck import RankBreakdown, RankContext, expert_load_advice
from plait.daemon.server import DaemonServer
from plait.proto.plait.v1 import daemon_pb2
from plait.tools import daemon_commands

STEPS = 4
TOP_K = 2


class RouterCount:
    """Counts, per step, what the router sent each expert and how many assignments it had."""

    def __init__(self) -> None:
        self.kept: torch.Tensor | None = None
        self.assignments = 0

    def wrap(self, layer: Any) -> None:
        run_experts: Callable[..., torch.Tensor] = layer.run_experts

        def counting(x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
            self.kept = counts.clone() if self.kept is None else self.kept + counts
            return run_experts(x, counts)

        layer.run_experts = counting
        layer.register_forward_pre_hook(self._count_assignments)

    def _count_assignments(self, module: Any, args: tuple[torch.Tensor, ...]) -> None:
        batch, seq, _ = args[0].shape
        self.assignments += batch * seq * TOP_K

    def take(self) -> tuple[list[int], int]:
        assert self.kept is not None
        kept = [int(v) for v in self.kept]
        dropped = self.assignments - sum(kept)
        self.kept, self.assignments = None, 0
        return kept, dropped


@pytest.mark.timeout(300)
def test_the_daemons_imbalance_figures_equal_the_routers_count(
    daemon_server: DaemonServer, daemon_stub: Any
) -> None:
    from plait.core.engine import Engine

    engine = Engine(
        config={
            # capacity_factor 1.0: the busiest experts overflow, so drops are counted too.
            "model": {
                "name": "moe",
                "size": "tiny",
                "overrides": {"max_seq_len": 32, "capacity_factor": 1.0, "top_k": TOP_K},
            },
            "data": {"seq_len": 16},
            "train": {"micro_batch_size": 2, "global_batch_size": 4, "seed": 0, "device": "cpu"},
            "parallel": {"transforms": {"ep": "ep"}},
            "telemetry": {"enabled": True, "daemon": daemon_server.address, "job_id": "moe"},
        },
        plugins=Plugins.create(autoload=False),
    )
    names = {id(m): normalised_name(n) for n, m in engine.module.named_modules()}
    counters = {}
    for module in engine.module.modules():
        if hasattr(module, "tokens_per_expert"):
            counters[names[id(module)]] = counter = RouterCount()
            counter.wrap(module)
    assert len(counters) == 2
    generator = torch.Generator().manual_seed(0)
    counted: list[dict[str, tuple[list[int], int]]] = []
    for _ in range(STEPS):
        tokens = torch.randint(0, engine.model_config.vocab_size, (4, 17), generator=generator)
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        counted.append({name: c.take() for name, c in counters.items()})
    engine.close()

    request = daemon_pb2.GetMetricsRequest(job_id="moe", window_steps=STEPS)
    (job,) = daemon_stub.GetMetrics(request).jobs
    layers = {layer.layer: layer for layer in job.expert_load}
    assert set(layers) == set(counters)
    last = counted[-1]
    for name, layer in layers.items():
        kept, dropped = last[name]
        mean = sum(kept) / len(kept)
        assert layer.step == STEPS and layer.steps == STEPS and layer.experts == len(kept)
        assert (layer.tokens, layer.max_tokens, layer.dropped) == (sum(kept), max(kept), dropped)
        assert layer.imbalance == pytest.approx(max(kept) / mean)
        assert layer.dropped_fraction == pytest.approx(dropped / (sum(kept) + dropped))
        history = [max(step[name][0]) * len(kept) / sum(step[name][0]) for step in counted]
        assert layer.mean_imbalance == pytest.approx(sum(history) / STEPS)
    assert sum(d for _, d in last.values()) > 0  # capacity 1.0 dropped some: the count is tested

    # The operator's view: plait status and plait top carry the same figures per layer.
    hosts = ["--host", daemon_server.address, "--job", "moe"]
    for command in (["status", "--json"], ["top", "--once", "--json"]):
        shown = CliRunner().invoke(daemon_commands.app, [*command, *hosts])
        assert shown.exit_code == 0, shown.output
        document = json.loads(shown.output)
        by_layer = {e["layer"]: e for e in document["expert_load"]}
        assert set(by_layer) == set(counters)
        for name, entry in by_layer.items():
            assert entry["max_tokens"] == max(last[name][0]) and entry["job_id"] == "moe"
            assert entry["imbalance"] == pytest.approx(layers[name].imbalance)


def test_expert_load_advice_names_the_imbalance_and_the_all_to_all() -> None:
    def breakdown(a2a: float) -> RankBreakdown:
        seconds = dict.fromkeys(
            ("compute", "exposed_comm", "data", "pipeline_bubble", "optimizer", "host_other"), 0.0
        )
        seconds.update(compute=0.05, exposed_comm=a2a + 0.001)
        return RankBreakdown(
            steps=5,
            step_seconds=0.05 + a2a + 0.001,
            seconds=seconds,
            comm_seconds=a2a + 0.001,
            exposed_comm_by_purpose={"moe_dispatch": a2a, "grad_bucket": 0.001},
            median_step_seconds=0.1,
            median_compute_seconds=0.05,
            microbatches=1,
        )

    skewed = RankContext(
        expert_imbalance=2.5, expert_layer="layers.1.feed_forward", expert_dropped_fraction=0.08
    )
    text = expert_load_advice(breakdown(0.04), skewed)
    assert "layers.1.feed_forward" in text and "2.50×" in text and "8.0%" in text
    assert "40.0 ms/step" in text and "aux_loss_coef" in text and "capacity_factor" in text
    balanced = RankContext(expert_imbalance=1.05, expert_layer="layers.1.feed_forward")
    assert expert_load_advice(breakdown(0.04), balanced) == ""  # nothing to say
    no_drops = RankContext(expert_imbalance=1.6, expert_layer="l")
    assert "capacity_factor" not in expert_load_advice(breakdown(0.0), no_drops)
    assert "ms/step" not in expert_load_advice(breakdown(0.0), no_drops)
