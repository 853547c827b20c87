"""Rank functions for the expert-parallel tests: train the tiny MoE model under several layouts
in one spawn and record each step's loss and every gradient, placed in its global tensor by the
declared state layout (so an ep rank's slice of the experts compares with the whole tensor)."""

from __future__ import annotations

from typing import Any

import torch

from plait.testing.distributed import VOCAB_SIZE, merged_config

Slices = tuple[tuple[int, int], ...]  # (offset, size) per dim of a piece in its global tensor


def _gradient_pieces(engine: Any) -> dict[str, tuple[Slices, torch.Tensor]]:
    from plait.core.state_layout import describe_state

    layout = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    pieces: dict[str, tuple[Slices, torch.Tensor]] = {}
    for entry in layout.parameters:
        grad = entry.param.grad
        if grad is None or len(entry.value.pieces) != 1:
            continue
        region = entry.value.pieces[0].region
        if region.flat is not None or region.numel != grad.numel():
            continue
        slices = tuple(zip(region.offsets, region.sizes, strict=True))
        pieces[entry.name] = (slices, grad.detach().reshape(region.sizes).clone())
    return pieces


def _parameter_pieces(engine: Any) -> list[tuple[str, Slices, tuple[int, int] | None, Any]]:
    """Every parameter piece this rank holds (ZeRO's flat ranges of its fp32 masters too):
    (name, block slices in the global tensor, flat range of the block or None, values)."""
    from plait.core.state_layout import describe_state

    layout = describe_state(engine.module, engine.optimizer, engine.runtimes, engine.mesh)
    pieces = []
    for entry in layout.parameters:
        for piece in entry.value.pieces:
            region = piece.region
            slices = tuple(zip(region.offsets, region.sizes, strict=True))
            values = piece.read().detach().float().reshape(-1).clone()
            pieces.append((entry.name, slices, region.flat, values))
    return pieces


def _moe_layers(module: torch.nn.Module) -> list[Any]:
    return [m for m in module.modules() if hasattr(m, "tokens_per_expert")]


def train_and_record(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]], steps: int
) -> dict[str, dict[str, Any]]:
    """Each case: losses, per step every gradient piece this rank holds, dropped assignments."""
    del rank, world_size
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    results: dict[str, dict[str, Any]] = {}
    for name, overrides in cases.items():
        config = merged_config(overrides)
        train, seq_len = config["train"], config["data"]["seq_len"]
        tokens = torch.randint(
            0,
            VOCAB_SIZE,
            (steps, train["global_batch_size"], seq_len + 1),
            generator=torch.Generator().manual_seed(train["seed"]),
        )
        engine = Engine(config=config, plugins=Plugins.create(autoload=False))
        recorded: list[dict[str, tuple[Slices, torch.Tensor]]] = []
        step_optimizer = engine.optimizer.step

        def record_then_step(
            *args: Any,
            _step: Any = step_optimizer,
            _engine: Any = engine,
            _recorded: list[Any] = recorded,
            **kwargs: Any,
        ) -> Any:
            _recorded.append(_gradient_pieces(_engine))
            return _step(*args, **kwargs)

        engine.optimizer.step = record_then_step
        exchanged = [0]  # rows this rank put into all-to-alls (forward and backward)
        issue_all_to_all = engine.comm.all_to_all

        def counting_all_to_all(
            output: torch.Tensor,
            input: torch.Tensor,
            _issue: Any = issue_all_to_all,
            _rows: list[int] = exchanged,
            **kwargs: Any,
        ) -> Any:
            _rows[0] += input.shape[0]
            return _issue(output, input, **kwargs)

        engine.comm.all_to_all = counting_all_to_all
        dp, dp_size = engine.mesh.coordinate("dp"), engine.mesh.size("dp")
        share = train["global_batch_size"] // dp_size
        losses, grad_norms, dropped = [], [], 0
        for step in range(steps):
            batch = tokens[step, dp * share : (dp + 1) * share]
            losses.append(engine.train_step((batch[:, :-1], batch[:, 1:])))
            grad_norms.append(engine.last_report.grad_norm if engine.last_report else None)
            dropped += sum(
                int(m.last_dropped)
                for m in _moe_layers(engine.module)
                if m.last_dropped is not None
            )
        parameters = _parameter_pieces(engine)
        engine.close()
        results[name] = {
            "parameters": parameters,  # after the last step
            "losses": losses,
            "grad_norms": grad_norms,
            "grads": recorded,
            "dropped": dropped,
            "all_to_all_rows": exchanged[0],  # over capacity in each step's last micro-batch
        }
    return results


def checkpoint_config(ep: int, steps: int) -> dict[str, Any]:
    """The tiny MoE model on 2 ranks at ep 1 (experts replicated) or ep 2, with the loss-free
    balancing bias on (a step of 0.05 moves the routing within the first steps)."""
    return {
        "model": {"name": "moe", "size": "tiny",
                  "overrides": {"max_seq_len": 32, "bias_update_rate": 0.05}},
        "data": {"seq_len": 16},
        "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "seed": 7,
                  "device": "cpu"},
        "optimizer": {"lr": 3e-3, "warmup_steps": 2},
        "parallel": {"ep": ep, "transforms": {"ep": "ep"}},
        "telemetry": {"enabled": False},
    }  # fmt: skip


def train_resume_save(
    rank: int, world_size: int, ep: int, ckpt_dir: str, steps: int, save_at: int, resume: bool
) -> dict[str, Any]:
    """Train to `steps` at `ep` (resuming from `ckpt_dir` if asked), saving after `save_at`."""
    del world_size
    from tests.dist.resharding_workers import train_with_checkpoints

    engine, start, losses = train_with_checkpoints(
        checkpoint_config(ep, steps), ckpt_dir, steps, (save_at,), resume
    )
    experts = sum(p.numel() for n, p in engine.module.named_parameters() if ".experts." in n)
    bias = [m.router.expert_bias.tolist() for m in _moe_layers(engine.module)]
    return {"rank": rank, "start": start, "losses": losses, "expert_numel": experts, "bias": bias}


def router_gradients(
    rank: int, world_size: int, cases: dict[str, dict[str, Any]]
) -> dict[str, dict[str, torch.Tensor]]:
    """Each case's fp32 router-weight gradients, unscaled, as the optimizer sees them at its
    first step (under fp16 the masters' gradients, after the loss scale is divided out)."""
    del rank, world_size
    from plait.core.engine import Engine
    from plait.core.plugins import Plugins

    results: dict[str, dict[str, torch.Tensor]] = {}
    for name, overrides in cases.items():
        config = merged_config(overrides)
        seq_len, batch = config["data"]["seq_len"], config["train"]["global_batch_size"]
        tokens = torch.randint(
            0, VOCAB_SIZE, (batch, seq_len + 1), generator=torch.Generator().manual_seed(3)
        )
        engine = Engine(config=config, plugins=Plugins.create(autoload=False))
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for runtime in engine.runtimes:  # fp16 master weights stand for their parameters
            for param, master in getattr(runtime, "pairs", []):
                names[id(master)] = names[id(param)]
        captured: dict[str, torch.Tensor] = {}
        step_optimizer = engine.optimizer.step

        def capture_then_step(
            *args: Any,
            _step: Any = step_optimizer,
            _optimizer: Any = engine.optimizer,
            _names: dict[int, str] = names,
            _captured: dict[str, torch.Tensor] = captured,
            **kwargs: Any,
        ) -> Any:
            for group in _optimizer.param_groups:
                for p in group["params"]:
                    name = _names[id(p)]
                    if "router" in name and p.grad is not None and name not in _captured:
                        _captured[name] = p.grad.detach().float().clone()
            return _step(*args, **kwargs)

        engine.optimizer.step = capture_then_step
        engine.train_step((tokens[:, :-1], tokens[:, 1:]))
        engine.close()
        results[name] = captured
    return results
