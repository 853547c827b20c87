"""Single-process parts of the ZeRO plugin: segment layout, file offload, config and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from plait.core.errors import ConfigError, PluginError
from plait.core.plugins import Plugins
from plait.plugins import zero
from plait.plugins.zero.config import ZeroConfig
from plait.plugins.zero.flat_buffer import Segment
from plait.plugins.zero.offload import FileOffload, check_writable
from plait.plugins.zero.stage3 import ROOT, find_units, unit_parameters


def _params() -> list[tuple[str, nn.Parameter]]:
    torch.manual_seed(0)
    return [
        ("bias", nn.Parameter(torch.randn(5))),
        ("weight", nn.Parameter(torch.randn(3, 7))),
        ("norm", nn.Parameter(torch.randn(3))),
    ]


@pytest.mark.parametrize("world_size", [1, 2, 4, 7])
def test_segment_chunks_cover_every_element_once_with_padding(world_size: int) -> None:
    params = _params()
    numel = sum(p.numel() for _, p in params)  # 29: divisible by none of 2, 4, 7
    segments = [Segment(0, params, world_size=world_size, rank=r) for r in range(world_size)]
    first = segments[0]
    assert first.padded_numel % world_size == 0
    assert numel <= first.padded_numel < numel + world_size
    # Matrices first, so every chunk splits into at most one matrix run and one vector run.
    assert [s.name for s in first.slots] == ["weight", "bias", "norm"]
    flat = first.flatten([s.param.detach() for s in first.slots], torch.empty(first.padded_numel))
    assert torch.equal(flat[numel:], torch.zeros(first.padded_numel - numel))
    covered = torch.zeros(numel)
    for seg in segments:
        runs = seg.runs()
        assert len(runs) <= 2 and all(r.numel > 0 for r in runs)
        for run in runs:
            lo = seg.chunk_start + run.start
            covered[lo : lo + run.numel] += 1
            assert run.is_matrix == (lo < 21)  # 3×7 matrix occupies the first 21 elements
        for piece in seg.pieces():
            chunk = seg.chunk_of(flat)
            got = chunk[piece.chunk_start : piece.chunk_start + piece.numel]
            want = piece.slot.param.detach().reshape(-1)[
                piece.param_start : piece.param_start + piece.numel
            ]
            assert torch.equal(got, want)
    assert torch.equal(covered, torch.ones(numel))


def test_segment_views_share_the_flat_buffer() -> None:
    params = _params()
    seg = Segment(0, params, world_size=2, rank=1)
    flat = torch.zeros(seg.padded_numel)
    views = seg.views(flat)
    views[0].fill_(1.0)  # the weight
    assert flat[:21].eq(1).all() and flat[21:].eq(0).all()


def test_file_offload_round_trip_frees_and_restores_storage(tmp_path: Path) -> None:
    tensors = {f"t{i}": torch.randn(1000 + i) for i in range(3)}
    expected = {k: v.clone() for k, v in tensors.items()}
    files = FileOffload(str(tmp_path), rank=0, io_workers=2)
    files.offload(tensors.items())
    files.wait()
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors.values())
    assert files.offloaded_bytes == sum(v.nbytes for v in expected.values())
    assert len(list(files.directory.iterdir())) == 3
    files.prefetch()
    files.offload(tensors.items())  # a write queued behind the read of the same tensor
    files.prefetch()
    files.wait()
    for key, tensor in tensors.items():
        assert torch.equal(tensor, expected[key])
    files.close()
    assert not files.directory.exists()


def test_offload_path_not_writable_names_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match=r"a-file/offload.*writable"):
        check_writable(str(blocker / "offload"))
    with pytest.raises(ConfigError, match="needs a directory"):
        check_writable("")


def test_config_rejects_bad_values() -> None:
    assert ZeroConfig().prefetch_count == 1
    assert ZeroConfig(prefetch=False).prefetch_count == 0
    assert ZeroConfig(prefetch=3).prefetch_count == 3
    with pytest.raises(ValueError, match="prefetch"):
        ZeroConfig(prefetch=-1)
    with pytest.raises(ValueError, match="'block' or a list"):
        ZeroConfig(unit="layer")
    with pytest.raises(ValueError, match="nvme"):
        ZeroConfig.model_validate({"offload": {"device": "disk"}})


def test_unknown_stage_lists_installed_strategies() -> None:
    plugins = Plugins.create(autoload=False, extra=[("zero", zero)])
    for name in ("zero1", "zero2", "zero3"):
        assert plugins.strategy("dp", name).config_section == "zero"
    with pytest.raises(PluginError, match=r"zero4.*zero1"):
        plugins.strategy("dp", "zero4")


class Block(nn.Module):
    def __init__(self, shared: nn.Linear | None = None) -> None:
        super().__init__()
        self.inner = shared or nn.Linear(4, 4)


class Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.layers = nn.ModuleList(blocks)


def test_units_default_to_model_layers_plus_root() -> None:
    model = Stack([Block(), Block()])
    units = find_units(model, "block")
    assert [name for name, _ in units] == ["layers.0", "layers.1"]
    params = unit_parameters(model, units)
    assert [n for n, _ in params[ROOT]] == ["embed.weight"]
    assert [n for n, _ in params["layers.1"]] == ["layers.1.inner.weight", "layers.1.inner.bias"]


def test_models_stage3_cannot_wrap_get_clear_errors() -> None:
    with pytest.raises(ConfigError, match=r"no container of repeated blocks.*\[zero\] unit"):
        find_units(nn.Sequential(nn.Linear(2, 2)), "block")
    with pytest.raises(ConfigError, match=r"no module of class \['Missing'\].*Linear"):
        find_units(Stack([Block()]), ["Missing"])
    shared = nn.Linear(4, 4)
    tied_blocks = Stack([Block(shared), Block(shared)])
    with pytest.raises(ConfigError, match=r"shared by units 'layers\.0' and 'layers\.1'"):
        unit_parameters(tied_blocks, find_units(tied_blocks, "block"))
    tied_root = Stack([Block()])
    tied_root.head = tied_root.layers[0].inner  # the root reuses a unit's parameters
    with pytest.raises(ConfigError, match=r"shared between unit 'layers\.0' and the rest"):
        unit_parameters(tied_root, find_units(tied_root, "block"))
