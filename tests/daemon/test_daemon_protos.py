"""The checked-in plait.v1 modules are exactly what tools/gen_protos.py produces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _gen_protos():
    spec = importlib.util.spec_from_file_location("gen_protos", REPO / "tools" / "gen_protos.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gen_protos", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
def test_regenerating_protos_changes_nothing() -> None:
    pytest.importorskip("grpc_tools")
    diff = _gen_protos().diff_against_checked_in()
    assert not diff, "run `python tools/gen_protos.py`:\n" + "".join(diff[:80])


def test_generated_modules_import_each_other_under_plait_proto() -> None:
    from plait.proto.plait.v1 import daemon_pb2, daemon_pb2_grpc, metrics_pb2

    text = (REPO / "proto/plait/v1/daemon_pb2.py").read_text()
    assert "from plait.proto.plait.v1 import metrics_pb2" in text
    assert text.startswith("# DO NOT EDIT")
    request = daemon_pb2.GetMetricsResponse(ranks=[metrics_pb2.RankMetrics(rank=3)])
    assert request.ranks[0].rank == 3
    assert hasattr(daemon_pb2_grpc, "DaemonStub")
    assert daemon_pb2.DESCRIPTOR.name == "plait/v1/daemon.proto"
