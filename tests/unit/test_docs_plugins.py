"""docs/plugins.md's "Writing a plugin" examples work as written: each file block is written out and
exercised in this process — records, selection by name, config validation, the int8 codec, the
fused kernel. Two-rank training with them is in `tests/e2e/test_plugin_packages.py`."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from plait.core.config import load_config
from plait.core.engine import check_config
from plait.core.errors import ConfigError
from plait.core.kernels import Kernels
from plait.core.plugins import Plugins, plugin_object
from plait.core.schedule import ScheduleRequest, format_action
from tests.doc_blocks import doc_files, page, write_files

EXAMPLES = {
    "my_dp": ("my_package.my_dp", "my_package/my_dp.py"),
    "reverse_accumulate": ("plait_reverse_accumulate", "plait-reverse-accumulate/"),
    "cpu_kernels": ("plait_cpu_kernels", "plait-cpu-kernels/"),
    "int8": ("plait_int8", "plait-int8/"),
}


@pytest.fixture
def examples(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Plugins:
    """The docs' files on sys.path (inherited by spawned ranks), registered by name."""
    write_files(tmp_path)
    (tmp_path / "my_package" / "__init__.py").write_text("")
    for folder in ("", "plait-reverse-accumulate", "plait-cpu-kernels", "plait-int8"):
        monkeypatch.syspath_prepend(str(tmp_path / folder))
    for module, _ in EXAMPLES.values():
        for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
    extra = [
        (name, plugin_object(importlib.import_module(module)))
        for name, (module, _) in EXAMPLES.items()
    ]
    return Plugins.create(autoload=False, extra=extra)


def test_every_example_file_is_in_the_plugins_page() -> None:
    files = doc_files(page("plugins.md"))
    for _, prefix in EXAMPLES.values():
        assert any(name.startswith(prefix) for name in files), prefix
    for package in ("plait-int8", "plait-reverse-accumulate", "plait-cpu-kernels"):
        assert "[project.entry-points.plait]" in files[f"{package}/pyproject.toml"]


def test_records_and_selection_by_name(examples: Plugins) -> None:
    assert examples.strategy("dp", "my_dp").config_cls is not None
    assert examples.comm_algorithms()["int8"][0] == "int8"
    request = ScheduleRequest(name="reverse_accumulate", num_microbatches=3)
    labels = [format_action(action) for action in examples.schedule(request)]
    assert labels == ["F2", "B2", "F1", "B1", "F0", "B0", "sync", "step"]
    # Installed but not preferred, the provider changes nothing; preferred, it answers on CPU.
    assert Kernels(examples).provider_of("rms_norm", "cpu", "float32") == "torch"
    preferred = Kernels(examples, prefer=["cpu_fused"])
    assert preferred.provider_of("rms_norm", "cpu", "float32") == "cpu_fused"
    assert preferred.provider_of("rms_norm", "cpu", "bfloat16") == "torch"


def test_fused_rms_norm_matches_the_reference(examples: Plugins) -> None:
    fused = Kernels(examples, prefer=["cpu_fused"]).get("rms_norm", "cpu", torch.float32)
    reference = Kernels(examples).get("rms_norm", "cpu", torch.float32)
    torch.manual_seed(0)  # the tolerances hold for these inputs every run, not most runs
    x = torch.randn(4, 7, 64, requires_grad=True)
    weight = torch.randn(64, requires_grad=True)
    outputs, grads = [], []
    for kernel in (fused, reference):
        y = kernel(x, weight, 1e-5)
        outputs.append(y)
        grads.append(torch.autograd.grad(y.square().sum(), (x, weight)))
    torch.testing.assert_close(outputs[0], outputs[1], rtol=1e-5, atol=1e-5)
    for fused_grad, reference_grad in zip(*grads, strict=True):
        torch.testing.assert_close(fused_grad, reference_grad, rtol=1e-4, atol=1e-4)


def test_config_tables_are_validated(examples: Plugins) -> None:
    good = {"comm": {"algorithm": "int8", "int8": {"block_size": 128}}, "my_dp": {"average": False}}
    check_config(load_config(good), examples)
    with pytest.raises(ConfigError, match=r"comm\.int8\.block_size"):
        check_config(load_config({"comm": {"int8": {"block_size": 0}}}), examples)
    with pytest.raises(ConfigError, match=r"comm\.int8\.scale"):
        check_config(load_config({"comm": {"int8": {"scale": 2}}}), examples)
    with pytest.raises(ConfigError, match=r"my_dp\.averag"):
        check_config(load_config({"my_dp": {"averag": True}}), examples)


def test_int8_codec_round_trip(examples: Plugins) -> None:
    del examples
    int8 = importlib.import_module("plait_int8")
    tensor = torch.randn(1000) * torch.logspace(-3, 2, 1000)
    block = 128
    restored = int8.dequantise(int8.quantise(tensor, block), tensor.numel(), block)
    for start in range(0, tensor.numel(), block):
        chunk = tensor[start : start + block]
        error = (restored[start : start + block] - chunk).abs().max()
        assert error <= chunk.abs().max() / 254 * 1.0001  # half a quantisation step
    assert int8.quantise(tensor, block).numel() == 1000 + 24 + 8 * 4  # padded values + scales
