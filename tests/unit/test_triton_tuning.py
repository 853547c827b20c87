"""The Triton kernels' autotuner: every candidate tile of every tuned kernel computes the op
(forced through the tuner, under the interpreter), and the tuner's choice — timed once per
problem and GPU model, kept on disk, never trusted when stale or corrupt, never attempted on a
CPU without a bench."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from plait.plugins.kernels_torch import ops as reference
from plait.plugins.kernels_torch.grouped_gemm import grouped_mm as grouped_reference
from tests.unit.triton_interpreter import interpreted_only

pytestmark = [
    pytest.mark.triton,
    pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning"),
    interpreted_only,
]
triton = pytest.importorskip("triton")

from plait.plugins.kernels_triton import attention as attention_module  # noqa: E402
from plait.plugins.kernels_triton import cross_entropy as cross_entropy_module  # noqa: E402
from plait.plugins.kernels_triton import grouped_gemm as grouped_module  # noqa: E402
from plait.plugins.kernels_triton import norms as norms_module  # noqa: E402
from plait.plugins.kernels_triton.tuning import (  # noqa: E402
    Bench,
    Tile,
    TileStore,
    TileTuner,
    tile,
    tuning,
)

CPU = torch.device("cpu")
TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


class Prefer:
    """A bench that ranks each tuner's `wanted` tile fastest and records what it was asked; it
    launches only the wanted ones (each candidate is wanted by one case)."""

    def __init__(self, wanted: dict[str, Tile] | None = None) -> None:
        self.wanted = wanted or {}
        self.asked: list[Tile] = []

    def __call__(self, kernel: str, candidate: Tile, run: Callable[[], object]) -> float:
        self.asked.append(candidate)
        if candidate != self.wanted[kernel]:
            return 1.0
        run()
        return 0.0


def _candidate(tuner: TileTuner, index: int) -> Tile:
    return tuner.candidates[index % len(tuner.candidates)]


def _assert_chosen(tuner: TileTuner, expected: Tile) -> None:
    chosen = set(tuner.chosen().values())
    assert chosen == {expected}, f"{tuner.kernel}: chose {chosen}, wanted {expected}"


def _forced_run(
    tuners: tuple[TileTuner, ...],
    index: int,
    shapes: list[tuple[int, ...]],
    ours_fn: Callable[..., torch.Tensor],
    reference_fn: Callable[..., torch.Tensor],
    store: TileStore,
    wanted: dict[str, Tile] | None = None,
) -> Prefer:
    """Forward and backward with each tuner forced to its candidate `index` (or to the tile
    `wanted` names for it), against the torch reference; every tuner must have chosen what it
    was told."""
    wanted = wanted or {tuner.kernel: _candidate(tuner, index) for tuner in tuners}
    generator = torch.Generator().manual_seed(index)
    ours = [torch.randn(shape, generator=generator).requires_grad_() for shape in shapes]
    theirs = [t.detach().clone().requires_grad_() for t in ours]
    bench = Prefer(wanted)
    with tuning(bench=bench, store=store):
        out, expected = ours_fn(*ours), reference_fn(*theirs)
        torch.testing.assert_close(out, expected, **TOLERANCE)
        upstream = torch.randn(out.shape, generator=generator)
        out.backward(upstream)
        expected.backward(upstream)
        for position, (mine, ref) in enumerate(zip(ours, theirs, strict=True)):
            torch.testing.assert_close(mine.grad, ref.grad, **TOLERANCE, msg=f"input {position}")
        for tuner in tuners:
            _assert_chosen(tuner, wanted[tuner.kernel])
    return bench


ATTENTION_TUNERS = (
    attention_module.FORWARD_TILES,
    attention_module.DQ_TILES,
    attention_module.DKDV_TILES,
)


@pytest.mark.parametrize("index", range(max(len(t.candidates) for t in ATTENTION_TUNERS)))
def test_every_attention_tile_computes_attention(index: int, tmp_path: Path) -> None:
    # 150 keys: two 128-row tiles, the second partial; grouped-query heads; causal.
    bench = _forced_run(
        ATTENTION_TUNERS,
        index,
        [(1, 4, 150, 16), (1, 2, 150, 16), (1, 2, 150, 16)],
        lambda q, k, v: attention_module.attention(q, k, v, causal=True),
        lambda q, k, v: reference.attention(q, k, v, True),
        TileStore(tmp_path / "tiles.json"),
    )
    assert len(bench.asked) == sum(len(t.candidates) for t in ATTENTION_TUNERS)


GROUP_SIZES = [130, 0, 37, 1, 200]  # an empty group, a group of one, groups over 128 rows
GROUPED_TUNERS = (grouped_module.ROWS_TILES, grouped_module.WEIGHT_GRAD_TILES)


@pytest.mark.parametrize("index", range(max(len(t.candidates) for t in GROUPED_TUNERS)))
def test_every_grouped_gemm_tile_computes_grouped_gemm(index: int, tmp_path: Path) -> None:
    counts = torch.tensor(GROUP_SIZES)
    _forced_run(
        GROUPED_TUNERS,
        index,
        [(sum(GROUP_SIZES), 40), (len(GROUP_SIZES), 72, 40)],
        lambda x, weight: grouped_module.grouped_mm(x, weight, counts),
        lambda x, weight: grouped_reference(x, weight, counts),
        TileStore(tmp_path / "tiles.json"),
    )


# The norms: 50 rows of 200 (a 256 block, padded), more rows than any count of programs tried.
NORM_ROWS, NORM_HIDDEN, NORM_BLOCK = 50, 200, 256
NORM_FORWARD, NORM_BACKWARD = (
    norms_module._row_candidates(NORM_BLOCK, backward) for backward in (False, True)
)


# Under the interpreter warps change nothing, programs per SM do: one case per count (4 warps),
# the forward alternating its warps; the GPU tier forces every tile.
@pytest.mark.parametrize("index", range(len(norms_module.PROGRAMS_PER_SM)))
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_every_norm_tile_computes_the_norm(op: str, index: int, tmp_path: Path) -> None:
    forward, backward = (
        getattr(norms_module, f"{op.upper()}_{p}_TILES") for p in ("FORWARD", "BACKWARD")
    )
    wanted = {
        forward.kernel: NORM_FORWARD[0][index % len(NORM_FORWARD[0])],
        backward.kernel: NORM_BACKWARD[0][index],
    }
    shapes = [(NORM_ROWS, NORM_HIDDEN), (NORM_HIDDEN,)] + (
        [(NORM_HIDDEN,)] if op == "layer_norm" else []
    )
    eps = 1e-5
    bench = _forced_run(
        (forward, backward),
        index,
        shapes,
        lambda *tensors: getattr(norms_module, op)(*tensors, eps),
        lambda *tensors: getattr(reference, op)(*tensors, eps),
        TileStore(tmp_path / "tiles.json"),
        wanted=wanted,
    )
    # Only the warps a 256-wide row can use are tried: the default 4 and 8, not 16 or 32.
    assert {tile.num_warps for tile in bench.asked} == {4, 8}
    assert len(bench.asked) == len(NORM_FORWARD[0]) + len(NORM_BACKWARD[0]) == 2 + 8


@pytest.mark.parametrize("index", range(3))
def test_every_cross_entropy_tile_computes_cross_entropy(index: int, tmp_path: Path) -> None:
    targets = torch.tensor([3, -100, 70, 0, 99, 41, -100])

    def ours(logits: torch.Tensor) -> torch.Tensor:
        return cross_entropy_module.softmax_cross_entropy(logits, targets, vocab_block=32)

    bench = _forced_run(
        (cross_entropy_module.FORWARD_TILES, cross_entropy_module.BACKWARD_TILES),
        index,
        [(7, 100)],
        ours,
        lambda logits: reference.softmax_cross_entropy(logits, targets, -100),
        TileStore(tmp_path / "tiles.json"),
    )
    assert {tile.num_warps for tile in bench.asked} == {4, 8, 16}


def test_the_chosen_programs_per_sm_shape_the_norm_backward(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from plait.plugins.kernels_triton.launch import INTERPRETER_PROGRAMS

    grids: list[tuple[int, ...]] = []
    kernel = norms_module._rms_norm_bwd

    class Recording:
        def __getitem__(self, grid: tuple[int, ...]) -> object:
            grids.append(grid)
            return kernel[grid]

    monkeypatch.setattr(norms_module, "_rms_norm_bwd", Recording())
    backward = norms_module.RMS_NORM_BACKWARD_TILES
    for per_sm in (2, 8):
        (wanted,) = [
            t
            for t in NORM_BACKWARD[0]
            if t.num_warps == 4 and t.host_setting("programs_per_sm", 0) == per_sm
        ]
        forward = norms_module.RMS_NORM_FORWARD_TILES
        with tuning(
            bench=Prefer({backward.kernel: wanted, forward.kernel: NORM_FORWARD[1]}),
            store=TileStore(tmp_path / f"{per_sm}.json"),
        ):
            x = torch.randn(NORM_ROWS, NORM_HIDDEN, requires_grad=True)
            norms_module.rms_norm(x, torch.ones(NORM_HIDDEN), 1e-6).sum().backward()
        # The last launch is the one that made the gradients: with the chosen tile.
        assert grids[-1] == (min(NORM_ROWS, INTERPRETER_PROGRAMS * per_sm),)


def test_a_tile_with_host_settings_round_trips_through_the_file(tmp_path: Path) -> None:
    chosen = tile(8, 3, host={"programs_per_sm": 4})
    assert Tile.from_json(json.loads(json.dumps(chosen.to_json()))) == chosen
    assert str(chosen) == "warps=8 stages=3 programs_per_sm=4"
    # An entry written before the tile had host settings is not one of the norms' tiles: it
    # is tuned again rather than trusted.
    assert Tile.from_json({"blocks": {}, "num_warps": 8, "num_stages": 3}) not in NORM_BACKWARD[0]


def test_a_narrowed_choice_must_stay_among_the_candidates(tuner: TileTuner) -> None:
    with tuning(bench=lambda kernel, candidate, run: 0.0), pytest.raises(ValueError, match="among"):
        tuner.choose(("float32", 1), lambda _: None, CPU, among=(SMALL, LARGE), default=HUGE)


# --- the tuner itself, on a kernel of its own -------------------------------------------------

SMALL, LARGE, HUGE = (tile(4, 2, BLOCK=size) for size in (16, 64, 256))


@pytest.fixture
def tuner() -> TileTuner:
    return TileTuner("test.kernel", (SMALL, LARGE, HUGE), default=SMALL)


def _timed(seconds: dict[Tile, float]) -> tuple[Bench, list[Tile]]:
    asked: list[Tile] = []

    def bench(kernel: str, candidate: Tile, run: Callable[[], object]) -> float:
        run()
        asked.append(candidate)
        return seconds[candidate]

    return bench, asked


def test_the_fastest_tile_is_chosen_once_per_problem(tuner: TileTuner, tmp_path: Path) -> None:
    bench, asked = _timed({SMALL: 3.0, LARGE: 1.0, HUGE: 2.0})
    launched: list[Tile] = []
    with tuning(bench=bench, store=TileStore(tmp_path / "tiles.json")):
        assert tuner.choose(("float32", 128), launched.append, CPU) == LARGE
        assert tuner.choose(("float32", 128), launched.append, CPU) == LARGE
        assert asked == [SMALL, LARGE, HUGE]  # timed the first time only
        assert launched == [SMALL, LARGE, HUGE]
        tuner.choose(("bfloat16", 128), launched.append, CPU)  # another problem: timed again
        assert len(asked) == 6


def test_the_choice_is_kept_on_disk_per_gpu_model(tuner: TileTuner, tmp_path: Path) -> None:
    path = tmp_path / "cache" / "tiles.json"
    bench, asked = _timed({SMALL: 3.0, LARGE: 1.0, HUGE: 2.0})
    with tuning(bench=bench, store=TileStore(path)):
        tuner.choose(("float32", 128), lambda _: None, CPU)
    saved = json.loads(path.read_text())
    (device,) = saved
    assert saved[device]["test.kernel"]["float32|128"] == LARGE.to_json()

    # A new process on the same GPU model reads it back and times nothing.
    never, never_asked = _timed({})
    with tuning(bench=never, store=TileStore(path)):
        assert tuner.choose(("float32", 128), lambda _: None, CPU) == LARGE
    assert never_asked == []

    # Another GPU model's choice is not this one's.
    other = {"NVIDIA H100 80GB HBM3": {"test.kernel": {"float32|64": HUGE.to_json()}}}
    path.write_text(json.dumps(other))
    bench, asked = _timed({SMALL: 3.0, LARGE: 1.0, HUGE: 2.0})
    with tuning(bench=bench, store=TileStore(path)):
        assert tuner.choose(("float32", 64), lambda _: None, CPU) == LARGE
    assert len(asked) == 3
    merged = json.loads(path.read_text())
    assert set(merged) == {"NVIDIA H100 80GB HBM3", device}  # the other model's entry is kept


def test_a_stale_or_corrupt_file_is_tuned_again(tuner: TileTuner, tmp_path: Path) -> None:
    path = tmp_path / "tiles.json"
    path.write_text("{not json")
    bench, asked = _timed({SMALL: 3.0, LARGE: 1.0, HUGE: 2.0})
    warns = pytest.warns(RuntimeWarning, match="ignoring the tuned Triton tiles")
    with warns, tuning(bench=bench, store=TileStore(path)):
        assert tuner.choose(("float32", 128), lambda _: None, CPU) == LARGE
    assert len(asked) == 3
    device = next(iter(json.loads(path.read_text())))  # rewritten whole

    # A tile this version no longer offers is not trusted.
    retired = tile(16, 1, BLOCK=1024).to_json()
    path.write_text(json.dumps({device: {"test.kernel": {"float32|128": retired}}}))
    bench, asked = _timed({SMALL: 3.0, LARGE: 1.0, HUGE: 2.0})
    with tuning(bench=bench, store=TileStore(path)):
        assert tuner.choose(("float32", 128), lambda _: None, CPU) == LARGE
    assert len(asked) == 3


@pytest.mark.parametrize(
    "content",
    [
        '{"DEVICE": ["not", "a", "table"]}',
        '{"DEVICE": {"test.kernel": 7}}',
        '{"DEVICE": {"test.kernel": {"float32|128": "BLOCK=64"}}}',
        '{"DEVICE": {"test.kernel": {"float32|128": {"blocks": 3, "num_warps": 4}}}}',
    ],
)
def test_entries_of_the_wrong_shape_are_tuned_again(
    tuner: TileTuner, tmp_path: Path, content: str
) -> None:
    path = tmp_path / "tiles.json"
    bench, asked = _timed({SMALL: 3.0, LARGE: 1.0, HUGE: 2.0})
    with tuning(bench=bench, store=TileStore(path)):
        tuner.choose(("float32", 64), lambda _: None, CPU)  # learns this machine's name
    device = next(iter(json.loads(path.read_text())))
    path.write_text(content.replace("DEVICE", device))
    with tuning(bench=bench, store=TileStore(path)):  # a new process reads the file
        assert tuner.choose(("float32", 128), lambda _: None, CPU) == LARGE
    assert len(asked) == 6
    assert json.loads(path.read_text())[device]["test.kernel"]["float32|128"] == LARGE.to_json()


def test_tiles_the_chip_cannot_run_are_skipped(tuner: TileTuner, tmp_path: Path) -> None:
    def bench(kernel: str, candidate: Tile, run: Callable[[], object]) -> float:
        if candidate != SMALL:
            raise triton.runtime.errors.OutOfResources(232448, 98304, "shared memory")
        return 5.0

    with tuning(bench=bench, store=TileStore(tmp_path / "tiles.json")):
        assert tuner.choose(("float32", 128), lambda _: None, CPU) == SMALL


def test_without_a_bench_a_cpu_uses_the_default_and_times_nothing(
    tuner: TileTuner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAIT_CACHE_DIR", str(tmp_path))
    launched: list[Tile] = []
    assert tuner.choose(("float32", 128), launched.append, CPU) == SMALL
    assert launched == [] and not (tmp_path / "triton-tiles.json").exists()


def test_a_default_outside_the_candidates_is_refused() -> None:
    with pytest.raises(ValueError, match="not a candidate"):
        TileTuner("test.bad", (LARGE, HUGE), default=SMALL)


def test_row_kernels_take_warps_by_row_width_when_compiled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from plait.plugins.kernels_triton.launch import default_row_warps

    assert norms_module.tile(8, 3).launch_options() == {}  # the interpreter takes no warps
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    widths = (1024, 2048, 4096, 8192, 16384)
    assert [default_row_warps(block) for block in widths] == [4, 8, 8, 16, 32]
    # The tuner tries the neighbours of the default a row of that width can use.
    tried = [
        sorted({t.num_warps for t in norms_module._row_candidates(b, False)[0]})
        for b in (64, 1024, 2048, 4096, 16384)
    ]
    assert tried == [[4], [4, 8], [4, 8, 16], [4, 8, 16], [16, 32]]
