"""LoRA adapters (peft) under DDP, ZeRO-1/2/3, context and pipeline parallelism on 2 Gloo ranks
equal one process; the frozen base takes no gradient bucket, no reduction and no optimizer state.

Adapters come from plait's `lora` transform (`[peft]`) or from the user's own `PeftModel`.
Figures checked: optimizer state = 8 bytes (fp32 Adam's two moments) per adapter parameter,
summed over the ranks that shard it; gradient bytes reduced per step = 4 per adapter parameter.
With `pp = 2` each stage holds its blocks' adapters: 4 gradient bytes and 8 optimizer-state bytes
per adapter parameter summed over the stages, and the checkpoint exports as one process's.
With `pp = 2` × `tp = 2` on 4 ranks (plait's built-in Llama) each stage's adapters are cut as its
tensor-parallel layers are, and train, checkpoint and export as one process's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from typer.testing import CliRunner

from plait.core.state_layout import Region
from plait.testing.distributed import run_distributed
from tests.dist import lora_workers

pytest.importorskip("transformers")
pytest.importorskip("peft")

LORA = {"parallel": {"transforms": {"adapter": "lora"}}, "peft": {
    "r": lora_workers.RANK, "alpha": 16, "target_modules": lora_workers.TARGETS,
}}  # fmt: skip
SHARDED = ("zero1", "zero2", "zero3")
# The pipelined and tensor-parallel cases' trained adapters: AdamW turns summation-order noise
# in tiny gradients into differences of about 1e-5 (1.5e-5 measured for the built-in Llama
# under tp = 2); their losses stay within 1e-5.
ADAPTER_TOL = 5e-5
CASES = {
    "ddp": {"config": {**LORA, "parallel": {**LORA["parallel"], "dp_strategy": "ddp"}}},
    **{
        name: {"config": {**LORA, "parallel": {**LORA["parallel"], "dp_strategy": name}}}
        for name in SHARDED
    },
    # Context parallelism: each rank holds half of every sequence, the adapters whole.
    "cp2": {"config": {**LORA, "parallel": {**LORA["parallel"], "cp": 2}}},
    "users_peft_model_ddp": {"users_model": True, "config": {"parallel": {"dp_strategy": "ddp"}}},
    "users_peft_model_zero2": {
        "users_model": True,
        "config": {"parallel": {"dp_strategy": "zero2"}},
    },
    "users_peft_model_zero3": {
        "users_model": True,
        "config": {"parallel": {"dp_strategy": "zero3"}},
    },
}


# Two pipeline stages (embeddings + block 0 | block 1 + norm + head), two micro-batches each.
PIPELINE = {"pp": 2}
PIPELINE_RUN = {"schedule": {"name": "1f1b"}, "train": {"micro_batch_size": 2}}
BUILTIN_LORA = {
    "parallel": LORA["parallel"],
    "peft": {**LORA["peft"], "target_modules": lora_workers.BUILTIN_TARGETS},
}
PIPELINE_CASES = {
    # A transformers Llama: stages around the model's own modules.
    "pp2": {
        "replicas": False,
        "config": {**LORA, **PIPELINE_RUN, "parallel": {**LORA["parallel"], **PIPELINE}},
    },
    # plait's built-in Llama: each stage a copy of the model holding its blocks.
    "builtin_pp2": {
        "builtin": True,
        "replicas": False,
        "config": {
            **lora_workers.BUILTIN,
            **BUILTIN_LORA,
            "schedule": {"name": "gpipe"},
            "train": {**lora_workers.BUILTIN["train"], "micro_batch_size": 2},
            "parallel": {**LORA["parallel"], **PIPELINE},
        },
    },
}

# Megatron tensor parallelism: q, k, v (wq, wk, wv) column-parallel, o (wo) row-parallel.
TENSOR_PARALLEL = {"tp": 2}
ROW_PARALLEL = ("o_proj", "wo")
TENSOR_PARALLEL_CASES = {
    "tp2": {
        "replicas": False,
        "config": {**LORA, "parallel": {**LORA["parallel"], **TENSOR_PARALLEL}},
    },
    # Four micro-batches: the whole factors' gradients are summed once, when final.
    "tp2_accumulate": {
        "replicas": False,
        "config": {
            **LORA,
            "train": {"micro_batch_size": 1},
            "parallel": {**LORA["parallel"], **TENSOR_PARALLEL},
        },
    },
    "tp2_sequence_parallel": {
        "replicas": False,
        "config": {
            **LORA,
            "tp": {"sequence_parallel": True},
            "parallel": {**LORA["parallel"], **TENSOR_PARALLEL},
        },
    },
    "builtin_tp2": {
        "builtin": True,
        "replicas": False,
        "config": {
            **lora_workers.BUILTIN,
            **BUILTIN_LORA,
            "parallel": {**LORA["parallel"], **TENSOR_PARALLEL},
        },
    },
}
CHECKPOINTED = ("pp2", "tp2")


@pytest.fixture(scope="module")
def reference() -> dict:
    return lora_workers.plain_loop()


@pytest.fixture(scope="module")
def builtin_reference() -> dict:
    """The built-in model with the transform in this process (no pipeline)."""
    return lora_workers.builtin_one_process({**lora_workers.BUILTIN, **BUILTIN_LORA})


@pytest.fixture(scope="module")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {name: tmp_path_factory.mktemp(f"lora_{name}") / "ckpt" for name in CHECKPOINTED}


@pytest.fixture(scope="module")
def runs(checkpoint_dirs: dict[str, Path]) -> list[dict]:
    """Every case on 2 ranks, in one start-up (rank 1's base starts perturbed: see the worker);
    the transformers Llama's pipelined and tensor-parallel jobs write a checkpoint each."""
    cases = {**CASES, **PIPELINE_CASES, **TENSOR_PARALLEL_CASES}
    for name, folder in checkpoint_dirs.items():
        cases[name] = {**cases[name], "checkpoint": str(folder)}
    # Refused, after every case that trains: the head of a transformers model's last stage is
    # called through the whole model, where peft's adapter would be skipped; under tensor
    # parallelism its logits are gathered, which no adapter is built for.
    lm_head = {"peft": {**LORA["peft"], "target_modules": ["lm_head"]}}
    for name in ("pp2", "tp2"):
        refused = {"refused": True, "config": {**cases[name]["config"], **lm_head}}
        cases[f"{name}_head"] = {**cases[name], **refused}
    return run_distributed(lora_workers.train_cases, 2, cases, timeout=200)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(CASES))
def test_lora_equals_one_process(name: str, reference: dict, runs: list[dict]) -> None:
    ranks = [run[name] for run in runs]
    assert all(r["cp"] == (2 if name == "cp2" else 1) for r in ranks)
    adapters = reference["adapters"]
    adapter_numel = sum(t.numel() for t in adapters.values())
    for result in ranks:
        assert result["module_class"] == "PeftModelForCausalLM"
        assert result["adapter_numel"] == adapter_numel  # the adapters alone train
        assert result["frozen_numel"] == result["base_numel"]  # the whole base is frozen
        assert result["frozen_unchanged"], "a frozen base weight changed or differs by rank"
        worst = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], reference["losses"])
        # Only the adapters' gradients travel: 4 bytes (fp32) each, once per step.
        assert sum(result["gradient_bytes_last_step"].values()) == 4 * adapter_numel
    # fp32 Adam: two moments of 4 bytes per adapter parameter, held once across the ranks.
    held = [r["optimizer_state_bytes"] for r in ranks]
    sharded = name.split("_")[-1] in SHARDED
    assert (sum(held) if sharded else held[0]) == 8 * adapter_numel
    if not sharded:
        assert held[0] == held[1]
    # The trained adapters equal the plain loop's, piece by piece, and the ranks cover them.
    covered = {n: 0 for n in adapters}
    for result in ranks:
        for entry_name, pieces in result["adapter_pieces"].items():
            for region, values in pieces:
                expected = lora_workers.part(adapters[entry_name], region)
                assert torch.allclose(values, expected, atol=1e-5, rtol=0), entry_name
                covered[entry_name] += region.numel if sharded else 0
    if sharded:
        assert covered == {n: t.numel() for n, t in adapters.items()}
    # Checkpoints leave the base out when the transform added the adapters (it is hashed);
    # a user's own PeftModel is checkpointed whole.
    assert all((r["frozen_in_checkpoints"] == 0) != name.startswith("users") for r in ranks)
    # The frozen base: whole on every rank, but sharded by ZeRO-3 (each rank holds its half).
    base_numel = ranks[0]["base_numel"]
    if name.endswith("zero3"):
        assert sum(r["frozen_held"] for r in ranks) == base_numel
        assert all(r["frozen_held"] < base_numel for r in ranks)
        assert all(r["frozen_bytes"] <= 4 * (base_numel // 2 + 64) for r in ranks)
    else:
        assert all(r["frozen_held"] == base_numel for r in ranks)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(PIPELINE_CASES))
def test_lora_pipeline_equals_one_process(
    name: str, reference: dict, builtin_reference: dict, runs: list[dict]
) -> None:
    """Each stage adapts the linears it holds, drawn as one process draws them; the frozen base
    takes no gradient and no optimizer state; the stages' checkpoint names are one process's."""
    from plait.plugins.lora.state import digests_hash, tensor_digests

    ranks = [run[name] for run in runs]
    expected = builtin_reference if name.startswith("builtin") else reference
    adapters = expected["adapters"]
    adapter_numel = sum(t.numel() for t in adapters.values())
    base_numel = sum(t.numel() for _, t in expected["frozen"])
    for result in ranks:
        assert result["pp"] == 2 and result["module_class"] == "PeftModel"
        worst = max(abs(a - b) for a, b in zip(result["losses"], expected["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], expected["losses"])
        assert result["frozen_unchanged"], "a frozen base weight changed"
        assert result["frozen_in_checkpoints"] == 0
        assert result["gradient_bytes_last_step"] == {}  # dp = 1: no gradient travels
        # Every stage adapts its own blocks' layers.
        assert 0 < result["adapter_numel"] < adapter_numel
    # Each stage holds its adapters' gradients and Adam moments, and nothing for the base.
    assert sum(r["adapter_numel"] for r in ranks) == adapter_numel
    assert sum(r["frozen_numel"] for r in ranks) == base_numel
    assert sum(r["frozen_held"] for r in ranks) == base_numel
    assert sum(r["gradient_bytes_held"] for r in ranks) == 4 * adapter_numel
    assert sum(r["optimizer_state_bytes"] for r in ranks) == 8 * adapter_numel
    # The trained adapters, by the names one process's peft gives them, split over the stages.
    held = [set(r["adapter_pieces"]) for r in ranks]
    assert not held[0] & held[1] and held[0] | held[1] == set(adapters)
    for result in ranks:
        for entry_name, pieces in result["adapter_pieces"].items():
            (region, values), *more = pieces
            assert not more and region == Region.whole(adapters[entry_name].shape)
            trained = adapters[entry_name].reshape(-1)
            assert torch.allclose(values, trained, atol=ADAPTER_TOL, rtol=0)
    # The base is hashed over both stages: the hash of one process's frozen tensors.
    records = [r["base_record"] for r in ranks]
    assert records[0] == records[1]
    assert records[0]["sha256"] == digests_hash(tensor_digests(expected["frozen"]))
    assert records[0]["parameters"] == len(expected["frozen"])


def test_lora_pipeline_refuses_adapters_the_stage_would_skip(runs: list[dict]) -> None:
    first, last = (run["pp2_head"]["error"] for run in runs)
    assert first is not None and "pipeline stage 0" in first and "lm_head" in first
    assert last is not None and "['lm_head']" in last and "through the whole model" in last


def test_lora_tensor_parallel_refuses_a_gathered_head(runs: list[dict]) -> None:
    for run in runs:
        error = run["tp2_head"]["error"]
        assert error is not None and "'lm_head': 'column, gathered output'" in error


def _cut_over_tp(name: str) -> bool:
    """Whether an adapter factor is cut over tp: B of a column-parallel layer, A of a row one."""
    module = name.split(".lora_")[0].rpartition(".")[2]
    return ".lora_A." in name if module in ROW_PARALLEL else ".lora_B." in name


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", sorted(TENSOR_PARALLEL_CASES))
def test_lora_tensor_parallel_equals_one_process(
    name: str, reference: dict, builtin_reference: dict, runs: list[dict]
) -> None:
    """Column-parallel layers: A whole, B cut on its output rows; row-parallel: A cut on its
    input columns, B whole; the whole factor's gradient summed over the tp ranks."""
    from plait.plugins.lora.state import digests_hash, tensor_digests

    ranks = [run[name] for run in runs]
    expected = builtin_reference if name.startswith("builtin") else reference
    adapters = expected["adapters"]
    cut = {n for n in adapters if _cut_over_tp(n)}
    held = sum(t.numel() // 2 if n in cut else t.numel() for n, t in adapters.items())
    whole = sum(t.numel() for n, t in adapters.items() if n not in cut)
    for result in ranks:
        assert result["tp"] == 2
        worst = max(abs(a - b) for a, b in zip(result["losses"], expected["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], expected["losses"])
        assert result["frozen_unchanged"], "a frozen base slice changed"
        assert result["frozen_in_checkpoints"] == 0
        # Each rank holds the whole factors and its half of the cut ones, with their gradients
        # and Adam moments, and nothing for the base.
        assert result["adapter_numel"] == held
        assert result["gradient_bytes_held"] == 4 * held
        assert result["optimizer_state_bytes"] == 8 * held
        # The whole factors' gradients, 4 bytes each, are summed over tp once per step.
        assert result["tp_gradient_bytes_last_step"] == 4 * whole
        assert result["gradient_bytes_last_step"] == {}  # dp = 1
    # Checkpoints hold each factor whole: the cut ones as the two ranks' halves.
    assert all(set(result["adapter_pieces"]) == set(adapters) for result in ranks)
    _assert_pieces_make_whole(ranks, adapters, cut)
    # The base is hashed whole, its slices gathered: one process's frozen tensors' hash.
    records = [r["base_record"] for r in ranks]
    assert records[0] == records[1]
    assert records[0]["sha256"] == digests_hash(tensor_digests(expected["frozen"]))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", CHECKPOINTED)
def test_lora_checkpoint_exports_whole(
    name: str,
    reference: dict,
    runs: list[dict],
    checkpoint_dirs: dict[str, Path],
    tmp_path: Path,
) -> None:
    """The pp = 2 and tp = 2 jobs' checkpoints export as one process's: peft's whole adapters,
    and the base with them merged (its hash checked over whole tensors) giving the trained
    logits."""
    # Each rank's fresh engine of the same job loaded the checkpoint: its adapters and Adam
    # moments are the trained ones (and the base it was built on passed the hash check).
    assert all(run[name]["resumed_same"] for run in runs)
    _assert_exports_whole(checkpoint_dirs[name], reference, tmp_path)


def _assert_pieces_make_whole(
    ranks: list[dict], adapters: dict[str, torch.Tensor], cut: set[str]
) -> None:
    """Every rank's checkpointed adapter pieces equal their regions of one process's adapters,
    and the tp pair covers each factor: a cut one once (two halves), a whole one twice."""
    covered = {n: 0 for n in adapters}
    for result in ranks:
        for entry_name, pieces in result["adapter_pieces"].items():
            for region, values in pieces:
                part = lora_workers.part(adapters[entry_name], region)
                assert torch.allclose(values, part, atol=ADAPTER_TOL, rtol=0), entry_name
                covered[entry_name] += region.numel
    assert covered == {n: t.numel() * (1 if n in cut else 2) for n, t in adapters.items()}


def _assert_exports_whole(
    checkpoint_dir: Path, reference: dict, tmp_path: Path, *, base: Path | None = None
) -> None:
    """`plait ckpt export` writes peft's whole adapters, as one process trained them, and
    `--merged` the base with them merged (its hash checked over whole tensors), giving the
    trained logits. `base`: a built-in model's base, as a plait checkpoint; none: the
    transformers Llama's, written here."""
    from safetensors.torch import load_file

    from plait.tools.ckpt_commands import app

    out = CliRunner().invoke(
        app, ["export", str(checkpoint_dir), "--format", "peft", "-o", str(tmp_path / "peft")]
    )
    assert out.exit_code == 0, out.output
    exported = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    expected = {n.replace(".default.", "."): t for n, t in reference["adapters"].items()}
    assert set(exported) == set(expected)
    for entry_name, tensor in exported.items():
        torch.testing.assert_close(tensor, expected[entry_name], atol=ADAPTER_TOL, rtol=0)
    _assert_merged_gives(checkpoint_dir, reference["logits"], tmp_path, base=base)


def _assert_merged_gives(
    checkpoint_dir: Path, logits: torch.Tensor, tmp_path: Path, *, base: Path | None = None
) -> torch.Tensor:
    """`plait ckpt export --merged` onto `base` (a built-in model's, as a plait checkpoint;
    none: the transformers Llama's, written here) loads with transformers and gives `logits`
    on the first batch; returns that batch's input ids."""
    import transformers

    from plait.tools.ckpt_commands import app

    if base is None:
        base = tmp_path / "base"
        lora_workers.build().save_pretrained(base)
        inputs = lora_workers.batches()[0]["input_ids"]
    else:
        inputs = lora_workers.builtin_batches()[0][0]
    merged_args = ["--merged", "--base", str(base), "-o", str(tmp_path / "merged")]
    out = CliRunner().invoke(app, ["export", str(checkpoint_dir), *merged_args])
    assert out.exit_code == 0, out.output
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    with torch.no_grad():
        got = merged(input_ids=inputs).logits
    torch.testing.assert_close(got, logits, atol=1e-4, rtol=0)
    return inputs


@pytest.mark.timeout(120)
def test_lora_pipeline_with_data_parallel_equals_one_process(reference: dict) -> None:
    """pp = 2 × DDP 2 on 4 ranks (rank = stage · 2 + replica; replica 1 starts perturbed and
    gets replica 0's weights): each stage's adapter gradients alone are all-reduced."""
    case = {
        "config": {
            **LORA,
            "schedule": {"name": "1f1b"},
            "train": {"micro_batch_size": 1},
            "parallel": {**LORA["parallel"], **PIPELINE, "dp_strategy": "ddp"},
        }
    }
    ranks = [run["pp2_dp2"] for run in run_distributed(
        lora_workers.train_cases, 4, {"pp2_dp2": case}, timeout=100
    )]  # fmt: skip
    adapters = reference["adapters"]
    adapter_numel = sum(t.numel() for t in adapters.values())
    for result in ranks:
        worst = max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], reference["losses"])
        assert result["frozen_unchanged"], "a frozen base weight changed or differs by replica"
        # Each stage's replicas reduce that stage's adapter gradients, once per step.
        assert result["gradient_bytes_last_step"] == {"all_reduce": 4 * result["adapter_numel"]}
        assert result["optimizer_state_bytes"] == 8 * result["adapter_numel"]
        for entry_name, [(region, values)] in result["adapter_pieces"].items():
            assert region == Region.whole(adapters[entry_name].shape)
            trained = adapters[entry_name].reshape(-1)
            assert torch.allclose(values, trained, atol=ADAPTER_TOL, rtol=0)
    for replica in (ranks[0::2], ranks[1::2]):  # stage 0's rank and stage 1's, per replica
        assert sum(r["adapter_numel"] for r in replica) == adapter_numel
        assert set().union(*(r["adapter_pieces"] for r in replica)) == set(adapters)


# pp = 2 × tp = 2 on 4 ranks, plait's built-in Llama (the pipeline split takes a transformers
# model with one of the two only): each stage's linears tensor-parallel, its adapters cut as
# they are; two micro-batches per step.
PIPELINE_TENSOR_PARALLEL = {
    **lora_workers.BUILTIN,
    **BUILTIN_LORA,
    "schedule": {"name": "1f1b"},
    "train": {**lora_workers.BUILTIN["train"], "micro_batch_size": 2},
    "parallel": {**LORA["parallel"], "pp": 2, "tp": 2},
}


@pytest.fixture(scope="module")
def pipeline_tensor_parallel(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The pp = 2 × tp = 2 job on 4 ranks; it writes a checkpoint and resumes from it."""
    folder = tmp_path_factory.mktemp("lora_pp2_tp2") / "ckpt"
    case = {"builtin": True, "config": PIPELINE_TENSOR_PARALLEL, "checkpoint": str(folder)}
    runs = run_distributed(lora_workers.train_cases, 4, {"pp2_tp2": case}, timeout=150)
    return {"ranks": [run["pp2_tp2"] for run in runs], "checkpoint": folder}


@pytest.mark.timeout(180)
def test_lora_pipeline_tensor_parallel_equals_one_process(
    builtin_reference: dict, pipeline_tensor_parallel: dict[str, Any]
) -> None:
    """Each stage adapts the tensor-parallel linears it holds: A whole and B cut on a
    column-parallel one, A cut and B whole on a row-parallel one, drawn as one process draws
    them; the base hashed over every stage's whole tensors; one process's checkpoint names."""
    from plait.plugins.lora.state import digests_hash, tensor_digests

    ranks = pipeline_tensor_parallel["ranks"]
    expected = builtin_reference
    adapters = expected["adapters"]
    cut = {n for n in adapters if _cut_over_tp(n)}
    held = sum(t.numel() // 2 if n in cut else t.numel() for n, t in adapters.items())
    whole = sum(t.numel() for n, t in adapters.items() if n not in cut)
    for result in ranks:
        assert (result["pp"], result["tp"]) == (2, 2)
        worst = max(abs(a - b) for a, b in zip(result["losses"], expected["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], expected["losses"])
        assert result["frozen_in_checkpoints"] == 0
        assert result["gradient_bytes_last_step"] == {}  # dp = 1
        assert result["gradient_bytes_held"] == 4 * result["adapter_numel"]
        assert result["optimizer_state_bytes"] == 8 * result["adapter_numel"]
    # Over the 4 ranks: each tp pair holds its stage's whole factors twice and its cut ones
    # once; each rank sums its whole factors' gradients (4 bytes each) over tp once a step.
    assert sum(r["adapter_numel"] for r in ranks) == 2 * held
    assert sum(r["tp_gradient_bytes_last_step"] for r in ranks) == 2 * 4 * whole
    # Checkpoint names: one process's peft names, each stage's on both of its tp ranks.
    by_stage = [[set(r["adapter_pieces"]) for r in ranks if r["stage"] == s] for s in (0, 1)]
    assert all(len(names) == 2 and names[0] == names[1] for names in by_stage)
    first, last = by_stage[0][0], by_stage[1][0]
    assert first and last and not first & last and first | last == set(adapters)
    # The trained factors, whole ones on both tp ranks of their stage, cut ones as two halves.
    _assert_pieces_make_whole(ranks, adapters, cut)
    records = [r["base_record"] for r in ranks]
    assert all(record == records[0] for record in records)
    assert records[0]["sha256"] == digests_hash(tensor_digests(expected["frozen"]))
    assert records[0]["parameters"] == len(expected["frozen"])
    # A fresh engine of the same job loaded the checkpoint: the trained adapters and moments.
    assert all(r["resumed_same"] for r in ranks)


@pytest.mark.timeout(120)
def test_lora_pipeline_tensor_parallel_checkpoint_exports_whole(
    builtin_reference: dict, pipeline_tensor_parallel: dict[str, Any], tmp_path: Path
) -> None:
    """The pp = 2 × tp = 2 job's checkpoint exports as one process's: peft's whole adapters,
    and merged into its base (a plait checkpoint of the built-in Llama) an HF Llama giving the
    one-process job's trained logits."""
    base = _builtin_base(builtin_reference, tmp_path)
    _assert_exports_whole(
        pipeline_tensor_parallel["checkpoint"], builtin_reference, tmp_path, base=base
    )


# A module trained in full beside the adapters (`[peft] modules_to_save`): the transformers
# Llama's head `lm_head`, the built-in Llama's `output` (its attention adapted, not its head).
SAVED_HEADS = {"transformers": "lm_head", "builtin": "output"}
SAVED_STRATEGIES = ("ddp", "zero3")


def _saved_config(model: str, strategy: str | None = None) -> dict[str, Any]:
    head = SAVED_HEADS[model]
    targets = lora_workers.TARGETS if model == "transformers" else ["wq", "wk", "wv", "wo"]
    peft = {**LORA["peft"], "target_modules": targets, "modules_to_save": [head]}
    config = {**LORA, "peft": peft}
    if model == "builtin":
        config = {**lora_workers.BUILTIN, **config}
    if strategy is not None:
        config["parallel"] = {**LORA["parallel"], "dp_strategy": strategy}
    return config


@pytest.fixture(scope="module")
def saved_reference() -> dict[str, dict]:
    """One process: peft's model by the user's loop, and the built-in model with the transform."""
    return {
        "transformers": lora_workers.plain_loop([SAVED_HEADS["transformers"]]),
        "builtin": lora_workers.builtin_one_process(_saved_config("builtin")),
    }


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Both models under DDP and ZeRO-3 on 2 ranks, in one start-up; each writes a checkpoint
    and a fresh engine of the same job resumes from it."""
    cases, folders = {}, {}
    for model in SAVED_HEADS:
        for strategy in SAVED_STRATEGIES:
            name = f"{model}_{strategy}"
            folders[name] = tmp_path_factory.mktemp(f"lora_saved_{name}") / "ckpt"
            cases[name] = {
                "builtin": model == "builtin",
                # Both ranks build the same base: its record is taken before rank 0's weights
                # are copied to rank 1, and the checkpoint holds each rank's.
                "replicas": False,
                "config": _saved_config(model, strategy),
                "checkpoint": str(folders[name]),
            }
    runs = run_distributed(lora_workers.train_cases, 2, cases, timeout=100)
    return {"runs": runs, "checkpoints": folders}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", sorted(SAVED_HEADS))
@pytest.mark.parametrize("strategy", SAVED_STRATEGIES)
def test_lora_modules_to_save_equal_one_process(
    model: str, strategy: str, saved_reference: dict[str, dict], saved_runs: dict[str, Any]
) -> None:
    """The head trains in full beside the adapters: its trained copy takes gradients and Adam
    moments and is checkpointed with them; its frozen original is left out, as the base is."""
    from plait.plugins.checkpoint.offline import model_weights, read_checkpoint

    name = f"{model}_{strategy}"
    ranks = [run[name] for run in saved_runs["runs"]]
    expected = saved_reference[model]
    trained = expected["adapters"]  # the adapters and the head's trained copy
    head = f"base_model.model.{SAVED_HEADS[model]}"
    assert f"{head}.modules_to_save.default.weight" in trained
    assert f"{head}.original_module.weight" in dict(expected["frozen"])
    numel = sum(t.numel() for t in trained.values())
    for result in ranks:
        worst = max(abs(a - b) for a, b in zip(result["losses"], expected["losses"], strict=True))
        assert worst <= 1e-5, (result["losses"], expected["losses"])
        assert result["adapter_numel"] == numel
        assert result["frozen_numel"] == sum(t.numel() for _, t in expected["frozen"])
        assert result["frozen_unchanged"], "a frozen base weight changed or differs by rank"
        assert result["frozen_in_checkpoints"] == 0  # the frozen original neither
        assert sum(result["gradient_bytes_last_step"].values()) == 4 * numel
        # A fresh engine of the same job loaded the copy and its moments as they were saved.
        assert result["resumed_same"]
    held = [r["optimizer_state_bytes"] for r in ranks]
    assert (sum(held) if strategy == "zero3" else held[0]) == 8 * numel
    covered = {n: 0 for n in trained}
    for result in ranks:
        assert set(result["adapter_pieces"]) <= set(trained)
        for entry_name, pieces in result["adapter_pieces"].items():
            for region, values in pieces:
                part = lora_workers.part(trained[entry_name], region)
                assert torch.allclose(values, part, atol=1e-5, rtol=0), entry_name
                covered[entry_name] += region.numel
    copies = 1 if strategy == "zero3" else 2
    assert covered == {n: t.numel() * copies for n, t in trained.items()}
    # The checkpoint: the adapters and the trained copy with their Adam moments, nothing else.
    folder = saved_runs["checkpoints"][name]
    weights, _ = model_weights(folder)
    assert set(weights) == set(trained)
    for entry_name, tensor in weights.items():
        torch.testing.assert_close(tensor, trained[entry_name], atol=1e-5, rtol=0)
    optim = read_checkpoint(folder, prefix="optim.")
    moments = {k for k in optim if k.endswith(lora_workers.ADAM_MOMENTS)}
    assert moments == {f"optim.{n}.{m}" for n in trained for m in lora_workers.ADAM_MOMENTS}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model", sorted(SAVED_HEADS))
def test_lora_modules_to_save_export(
    model: str, saved_reference: dict[str, dict], saved_runs: dict[str, Any], tmp_path: Path
) -> None:
    """The ZeRO-3 job's checkpoint (each rank wrote half the head): `--merged` puts the trained
    head in the base's place, giving the trained logits; the transformers model's `--format
    peft` folder loads with peft onto its base, its files named as peft's own."""
    import peft
    from safetensors.torch import load_file

    from plait.tools.ckpt_commands import app

    expected = saved_reference[model]
    folder = saved_runs["checkpoints"][f"{model}_zero3"]
    base = None if model == "transformers" else _builtin_base(expected, tmp_path)
    inputs = _assert_merged_gives(folder, expected["logits"], tmp_path, base=base)
    if model != "transformers":
        return
    out = CliRunner().invoke(
        app, ["export", str(folder), "--format", "peft", "-o", str(tmp_path / "peft")]
    )
    assert out.exit_code == 0, out.output
    own = lora_workers.users_peft_model([SAVED_HEADS[model]])
    own.save_pretrained(tmp_path / "peft_own")
    written = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    assert set(written) == set(load_file(str(tmp_path / "peft_own" / "adapter_model.safetensors")))
    loaded = peft.PeftModel.from_pretrained(lora_workers.build(), tmp_path / "peft")
    with torch.no_grad():
        logits = loaded(input_ids=inputs).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-4, rtol=0)


def _builtin_base(reference: dict, tmp_path: Path) -> Path:
    """The built-in Llama's base, a plait checkpoint of the frozen tensors the job started from."""
    from plait.plugins.checkpoint.offline import write_checkpoint
    from plait.plugins.checkpoint.state import FORMAT
    from plait.plugins.lora.state import base_weight_name

    base = {f"model.{base_weight_name(n)}": t for n, t in reference["frozen"]}
    meta = {
        "format": FORMAT,
        "world_size": 1,
        "degrees": {},
        "model": lora_workers.BUILTIN["model"],
    }
    write_checkpoint(tmp_path / "base", 0, {**base, "meta": meta})
    return tmp_path / "base"
