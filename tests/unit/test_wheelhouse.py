"""`make wheelhouse` (tools/wheelhouse.py): what an offline GPU node needs, and nothing it owns."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from plait.tools import wheelhouse


def test_a_manylinux_tag_widens_to_every_older_one() -> None:
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert "manylinux_2_17_x86_64" in tags and "manylinux2014_x86_64" in tags
    assert "manylinux_2_29_x86_64" not in tags  # newer than the node's glibc
    older = wheelhouse.platform_tags("manylinux_2_12_aarch64")
    assert older[-2:] == ["manylinux2010_aarch64", "manylinux1_aarch64"]
    assert wheelhouse.platform_tags("macosx_14_0_arm64") == ["macosx_14_0_arm64"]


@pytest.mark.parametrize(
    ("name", "left_out"),
    [("torch", True), ("Triton", True), ("nvidia-nccl-cu13", True), ("nvidia_cublas", True),
     ("nvidia-ml-py", False), ("grpcio", False), ("torchvision", False), ("numpy", False)],
)  # fmt: skip
def test_the_nodes_own_stack_is_left_out(name: str, left_out: bool) -> None:
    """torch, triton and the CUDA libraries are the node's; NVML's pure-Python bindings are
    plait's to bring."""
    assert wheelhouse.node_owns(name) is left_out


def _wheel_with(tmp_path: Path, requires: list[str]) -> Path:
    wheel = tmp_path / "demo-1.0-py3-none-any.whl"
    metadata = "Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n" + "".join(
        f"Requires-Dist: {line}\n" for line in requires
    )
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("demo-1.0.dist-info/METADATA", metadata)
    return wheel


def test_requirements_of_the_chosen_extras_only(tmp_path: Path) -> None:
    wheel = _wheel_with(
        tmp_path,
        ["torch>=2.4", "grpcio>=1.85.1", 'numpy>=1.26; python_version >= "3.10"',
         'transformers>=4.57; extra == "hf"', 'pytest>=8; extra == "dev"'],
    )  # fmt: skip
    plain = wheelhouse.wheel_requirements(wheel, ())
    assert plain == ["torch>=2.4", "grpcio>=1.85.1", 'numpy>=1.26; python_version >= "3.10"']
    assert wheelhouse.wheel_requirements(wheel, ("hf",))[-1] == "transformers>=4.57"
    assert [wheelhouse.requirement_name(r) for r in plain] == ["torch", "grpcio", "numpy"]


@pytest.mark.timeout(300)
def test_plaits_wheel_alone_when_the_node_has_everything_else(tmp_path: Path) -> None:
    """No index is needed when every dependency is assumed present: the wheelhouse is plait's
    freshly built wheel, and no stale staging folder is left in the checkout."""
    wheels = wheelhouse.build(tmp_path / "wh", assume_present=["*"])
    assert [w.name for w in wheels] == ["plait-0.1.0-py3-none-any.whl"]
    requires = wheelhouse.wheel_requirements(wheels[0], ())
    names = {wheelhouse.requirement_name(r) for r in requires}
    assert {"torch", "grpcio", "protobuf", "opentelemetry-sdk"} <= names
    assert not (wheelhouse.REPO_ROOT / "build").exists()
