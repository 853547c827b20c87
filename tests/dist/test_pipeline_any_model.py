"""Pipeline parallelism of users' own models on 2 Gloo ranks, and what the pipeline refuses.

A model whose forward is the chain embed → blocks (x = block(x)) → head, passed to
`plait.initialize` as it is, trains over two stages exactly as the plain single-process loop
(fp32, 5 steps, 1e-5); so does a model without a block container cut at
`pipeline.split_points`. The transformers families are in `test_hf_models.py`.
"""

from __future__ import annotations

import pytest

from plait.testing.distributed import run_distributed
from tests.dist import pp_any_workers

TOL = 1e-5
PP2 = {"parallel": {"pp": 2}, "schedule": {"name": "1f1b"}, "train": {"micro_batch_size": 2}}
RUNS = {
    "chain_1f1b": {"model": "chain", "config": PP2},
    "chain_gpipe": {"model": "chain", "config": {**PP2, "schedule": {"name": "gpipe"}}},
    "chain_split_points": {
        "model": "chain",
        "config": {**PP2, "pipeline": {"split_points": ["blocks.3"]}},
    },
    "named_split_points": {
        "model": "named",
        "config": {**PP2, "pipeline": {"split_points": ["mix"]}},
    },
}
REFUSALS = {
    "not_a_chain": {"model": "residual", "config": PP2},
    "unknown_split_point": {
        "model": "chain",
        "config": {**PP2, "pipeline": {"split_points": ["head"]}},
    },
    "no_blocks_no_split_points": {"model": "named", "config": PP2},
    "tied_with_zero": {
        "model": "gpt2_tied",
        "config": {**PP2, "parallel": {"pp": 2, "dp_strategy": "zero1"}},
    },
}


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    pytest.importorskip("transformers")  # the tied-embeddings refusal uses GPT-2
    return run_distributed(pp_any_workers.train_and_refuse, 2, RUNS, REFUSALS, timeout=180)


@pytest.mark.dist
def test_users_models_match_the_plain_loop(ranks: list[dict]) -> None:
    for results in (r["runs"] for r in ranks):
        for name, run in RUNS.items():
            reference = results[f"reference_{run['model']}"]
            got = results[name]["losses"]
            assert got == pytest.approx(reference, abs=TOL, rel=TOL), (name, got, reference)
    # Each rank holds its stage's own modules (not copies) under the model's own names.
    chain = [r["runs"]["chain_split_points"]["params"] for r in ranks]
    assert any(n.startswith("embed.") for n in chain[0]) and "blocks.2.norm.weight" in chain[0]
    assert "blocks.3.norm.weight" in chain[1] and any(n.startswith("head.") for n in chain[1])
    assert not set(chain[0]) & set(chain[1])
    named = [r["runs"]["named_split_points"]["params"] for r in ranks]
    assert {n.split(".")[0] for n in named[0]} == {"embed", "first"}
    assert {n.split(".")[0] for n in named[1]} == {"mix", "out"}


@pytest.mark.dist
def test_refusals_name_what_was_found(ranks: list[dict]) -> None:
    messages = ranks[0]["refusals"]
    assert "not a plain chain" in messages["not_a_chain"], messages
    assert "add" in messages["not_a_chain"], messages
    assert "['head'] name no block" in messages["unknown_split_point"], messages
    assert "blocks.1" in messages["unknown_split_point"], messages
    assert "found no repeated blocks in NamedStack" in messages["no_blocks_no_split_points"]
    assert "pipeline.split_points" in messages["no_blocks_no_split_points"]
    assert "transformer.wte.weight" in messages["tied_with_zero"], messages
    assert "dp_strategy 'zero1'" in messages["tied_with_zero"], messages
