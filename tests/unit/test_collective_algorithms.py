"""Ring and halving-doubling all-reduce on an in-memory network of threads, plus selection logic.

Each rank is a thread; a send puts a copy on the (src, dst) queue and a receive takes from it, in
order, the way Gloo matches point-to-point messages. This checks every group size 1-8 and odd
tensor sizes in a second, without spawning processes; tests/dist checks the same code on Gloo.
"""

from __future__ import annotations

import queue
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.core.comm import CompletedWork, Group
from plait.core.comm_algorithms import (
    GRAD_BUCKET,
    PURPOSES,
    AlgorithmRunner,
    axis_rank_sets,
    is_sub_op,
    sub_purpose,
)
from plait.core.config import load_config
from plait.core.engine import check_config
from plait.core.errors import ConfigError, PluginError
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.plugins.collectives import CollectivesPlugin
from plait.plugins.collectives.config import TreeConfig
from plait.plugins.collectives.ring import ring_all_reduce, ring_reduce_scatter
from plait.plugins.collectives.tree import halving_doubling_all_reduce

SIZES = (0, 1, 2, 3, 7, 8, 64, 1001)
REDUCERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda stacked: stacked.sum(0),
    "avg": lambda stacked: stacked.mean(0),
    "max": lambda stacked: stacked.amax(0),
    "min": lambda stacked: stacked.amin(0),
}


class _Receive:
    def __init__(self, source: queue.Queue[torch.Tensor], into: torch.Tensor) -> None:
        self.source, self.into = source, into

    def wait(self) -> bool:
        incoming = self.source.get(timeout=10)
        assert incoming.shape == self.into.shape, "send and receive sizes do not match"
        self.into.copy_(incoming)
        return True


class ThreadNetwork:
    """FIFO channels between every ordered pair of ranks."""

    def __init__(self, world_size: int) -> None:
        self.channels = {
            (a, b): queue.Queue() for a in range(world_size) for b in range(world_size)
        }
        self.sent_elements = [0] * world_size
        self.purposes: set[str] = set()

    def comm(self, rank: int) -> Any:
        network = self

        class RankComm:
            def send(self, tensor: torch.Tensor, *, dst: int, purpose: str, **_: Any) -> Any:
                network.purposes.add(purpose)
                network.sent_elements[rank] += tensor.numel()
                network.channels[(rank, dst)].put(tensor.clone())
                return CompletedWork()

            def recv(self, tensor: torch.Tensor, *, src: int, **_: Any) -> Any:
                return _Receive(network.channels[(src, rank)], tensor)

        return RankComm()


def run_all_reduce(
    algorithm: Callable[..., None], inputs: list[torch.Tensor], reduce_op: str, **kwargs: Any
) -> tuple[list[torch.Tensor], ThreadNetwork]:
    world_size = len(inputs)
    network = ThreadNetwork(world_size)
    group = Group(name="world", ranks=tuple(range(world_size)))
    tensors = [t.clone() for t in inputs]

    def rank_main(rank: int) -> None:
        algorithm(
            network.comm(rank),
            tensors[rank],
            group=group,
            rank=rank,
            reduce_op=reduce_op,
            purpose="test/generic",
            **kwargs,
        )

    with ThreadPoolExecutor(world_size) as pool:
        for future in [pool.submit(rank_main, r) for r in range(world_size)]:
            future.result(timeout=30)
    return tensors, network


ALGORITHMS = {
    "ring": (ring_all_reduce, {}),
    "ring_pieces": (ring_all_reduce, {"piece_bytes": 8}),  # 2-element pieces, pipelined
    "tree_halving": (halving_doubling_all_reduce, {"small_message_bytes": 0}),
    "tree_doubling": (halving_doubling_all_reduce, {"small_message_bytes": 1 << 30}),
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
@pytest.mark.parametrize("world_size", range(1, 9))
def test_all_reduce_matches_reference_for_every_size(name: str, world_size: int) -> None:
    algorithm, kwargs = ALGORITHMS[name]
    generator = torch.Generator().manual_seed(world_size)
    for numel in SIZES:
        inputs = [torch.randn(numel, generator=generator) for _ in range(world_size)]
        for reduce_op, reference in REDUCERS.items():
            results, _ = run_all_reduce(algorithm, inputs, reduce_op, **kwargs)
            expected = reference(torch.stack(inputs))
            for result in results:
                torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-5)
                # Replicas must agree bit for bit, not just approximately.
                assert torch.equal(result, results[0])


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_integer_sums_are_exact_and_shapes_are_kept(name: str) -> None:
    algorithm, kwargs = ALGORITHMS[name]
    inputs = [torch.arange(35, dtype=torch.int64).reshape(5, 7) * (r + 1) for r in range(3)]
    results, _ = run_all_reduce(algorithm, inputs, "sum", **kwargs)
    for result in results:
        assert result.shape == (5, 7)
        assert torch.equal(result, torch.arange(35).reshape(5, 7) * 6)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_non_contiguous_tensors_are_reduced_in_place(name: str) -> None:
    algorithm, kwargs = ALGORITHMS[name]
    inputs = [torch.full((4, 6), float(r)).t() for r in range(3)]
    assert not inputs[0].is_contiguous()
    results, _ = run_all_reduce(algorithm, inputs, "sum", **kwargs)
    assert all(torch.equal(r, torch.full((6, 4), 3.0)) for r in results)


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_bandwidth_optimal_algorithms_send_two_thirds_of_the_vector_at_three(
    world_size: int,
) -> None:
    numel = 1024 * world_size
    inputs = [torch.ones(numel) for _ in range(world_size)]
    optimal = 2 * (world_size - 1) * numel // world_size
    for name in ("ring", "ring_pieces", "tree_halving"):
        algorithm, kwargs = ALGORITHMS[name]
        _, network = run_all_reduce(algorithm, inputs, "sum", **kwargs)
        assert network.sent_elements == [optimal] * world_size, name
    # Recursive doubling trades bandwidth for fewer steps: the whole vector, log2(p) times.
    algorithm, kwargs = ALGORITHMS["tree_doubling"]
    _, network = run_all_reduce(algorithm, inputs, "sum", **kwargs)
    steps = world_size.bit_length() - 1
    assert network.sent_elements == [steps * numel] * world_size


@pytest.mark.parametrize("piece_bytes", [1 << 20, 8], ids=["whole-chunks", "pieces"])
@pytest.mark.parametrize("world_size", [1, 2, 3, 5])
def test_ring_reduce_scatter_leaves_rank_i_chunk_i_and_sends_one_phase(
    world_size: int, piece_bytes: int
) -> None:
    numel = 6 * world_size
    inputs = [torch.arange(numel, dtype=torch.float32) * (r + 1) for r in range(world_size)]
    outputs = [torch.empty(6) for _ in range(world_size)]
    network = ThreadNetwork(world_size)
    group = Group(name="world", ranks=tuple(range(world_size)))

    def rank_main(rank: int) -> None:
        ring_reduce_scatter(
            network.comm(rank), outputs[rank], inputs[rank], group=group, rank=rank,
            reduce_op="avg", purpose="test/generic", piece_bytes=piece_bytes,
        )  # fmt: skip

    with ThreadPoolExecutor(world_size) as pool:
        for future in [pool.submit(rank_main, r) for r in range(world_size)]:
            future.result(timeout=30)
    mean = torch.stack(inputs).mean(0)
    for rank, output in enumerate(outputs):
        torch.testing.assert_close(output, mean[rank * 6 : (rank + 1) * 6])
        assert torch.equal(inputs[rank], torch.arange(numel, dtype=torch.float32) * (rank + 1))
    assert network.sent_elements == [(world_size - 1) * 6] * world_size


class LazyNetwork:
    """Gloo-like sends: the receiver reads the sender's buffer when it waits, and a send is
    complete only once read, so overwriting a buffer whose send is in flight corrupts the
    result. Records each rank's sends and receive-waits in order."""

    def __init__(self, world_size: int) -> None:
        self.channels = {
            (a, b): queue.Queue() for a in range(world_size) for b in range(world_size)
        }
        self.events: list[list[str]] = [[] for _ in range(world_size)]

    def comm(self, rank: int) -> Any:
        network = self

        class Sent:
            def __init__(self, tensor: torch.Tensor) -> None:
                self.tensor, self.read = tensor, threading.Event()

            def wait(self) -> bool:
                assert self.read.wait(timeout=10), "send never received"
                return True

        class Received:
            def __init__(self, source: queue.Queue[Sent], into: torch.Tensor) -> None:
                self.source, self.into = source, into

            def wait(self) -> bool:
                sent = self.source.get(timeout=10)
                network.events[rank].append("wait")
                assert sent.tensor.shape == self.into.shape, "send and receive sizes differ"
                self.into.copy_(sent.tensor)
                sent.read.set()
                return True

        class RankComm:
            def send(self, tensor: torch.Tensor, *, dst: int, **_: Any) -> Any:
                network.events[rank].append("send")
                sent = Sent(tensor)
                network.channels[(rank, dst)].put(sent)
                return sent

            def recv(self, tensor: torch.Tensor, *, src: int, **_: Any) -> Any:
                return Received(network.channels[(src, rank)], tensor)

        return RankComm()


def _lazy_ring(inputs: list[torch.Tensor], piece_bytes: int) -> tuple[list[Any], LazyNetwork]:
    network = LazyNetwork(len(inputs))
    group = Group(name="world", ranks=tuple(range(len(inputs))))
    tensors = [t.clone() for t in inputs]
    with ThreadPoolExecutor(len(inputs)) as pool:
        futures = [
            pool.submit(
                ring_all_reduce,
                network.comm(r),
                tensors[r],
                group=group,
                rank=r,
                reduce_op="avg",
                purpose="test/generic",
                piece_bytes=piece_bytes,
            )
            for r in range(len(inputs))
        ]
        for future in futures:
            future.result(timeout=30)
    return tensors, network


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ring_pieces_are_pipelined_and_exact_when_sends_are_read_late(world_size: int) -> None:
    generator = torch.Generator().manual_seed(world_size)
    inputs = [torch.randn(64 * world_size, generator=generator) for _ in range(world_size)]
    results, network = _lazy_ring(inputs, piece_bytes=16 * 4)  # 4 pieces of each 64-float chunk
    expected = torch.stack(inputs).mean(0)
    for result in results:
        torch.testing.assert_close(result, expected)
        assert torch.equal(result, results[0])
    for events in network.events:
        waits = [i for i, e in enumerate(events) if e == "wait"]
        assert events.count("send") == 2 * (world_size - 1) * 4  # every piece of every step
        # Pipelined: the next step's first piece goes out after the first piece of this step
        # arrived, while the other three are still awaited (not once the whole chunk is in).
        assert "send" in events[waits[0] : waits[3]], events[: waits[3] + 1]


def _request(op: str = "all_reduce", purpose: str = GRAD_BUCKET, **fields: Any) -> CommRequest:
    tensors = (torch.ones(2), torch.ones(4)) if op == "reduce_scatter" else (torch.ones(3),)
    return CommRequest(
        op=op,  # type: ignore[arg-type]
        tensors=tensors,
        group=None,
        group_name="world",
        group_ranks=(0, 1),
        seq=0,
        purpose=purpose,
        **fields,
    )


def test_plugin_takes_over_only_what_it_is_configured_for() -> None:
    plugin = CollectivesPlugin()
    assert plugin.plait_communicate(request=_request()) is None  # algorithm = "torch"

    plugin.plait_configure(config=load_config({"comm": {"algorithm": "ring"}}))
    assert plugin.algorithm == "ring"
    assert plugin.plait_communicate(request=_request(op="broadcast")) is None
    assert plugin.plait_communicate(request=_request(purpose="ring/grad_bucket")) is None
    # Reduce-scatters are taken over for gradients only (ZeRO-2/3 on GPU), not for tp.
    assert plugin.takes_over(_request(op="reduce_scatter"))
    assert not plugin.takes_over(_request(op="reduce_scatter", purpose="tp_activation"))
    with pytest.raises(PluginError, match="bind"):
        plugin.plait_communicate(request=_request())

    config = load_config(
        {
            "comm": {
                "algorithm": "tree",
                "tree": {"purposes": ["activation"], "small_message_bytes": 8},
            }
        }
    )
    plugin.plait_configure(config=config)
    assert plugin.options == TreeConfig(purposes=["activation"], small_message_bytes=8)
    assert plugin.plait_communicate(request=_request(purpose="grad_bucket")) is None


def test_config_errors_name_the_field_and_the_alternatives() -> None:
    plugins = Plugins.create(autoload=False)

    def check(comm: dict[str, Any]) -> None:
        check_config(load_config({"comm": comm}), plugins, with_model=False)

    with pytest.raises(ConfigError, match=r"comm\.powersgd\.rank"):
        check({"powersgd": {"rank": 0}})
    with pytest.raises(ConfigError, match=r"comm\.topk\.ratios"):
        check({"topk": {"ratios": 0.1}})
    with pytest.raises(ConfigError, match=r"comm\.param_server\.mode"):
        check({"param_server": {"mode": "later"}})
    with pytest.raises(ConfigError, match=r"comm\.tree\.small_message_bytes"):
        check({"tree": {"small_message_bytes": -1}})
    with pytest.raises(ConfigError, match=r"comm\.anything: not a field"):
        check({"anything": 1})
    with pytest.raises(PluginError, match=r"'rnig'.*'ring'.*'tree'"):
        check({"algorithm": "rnig"})
    check({"algorithm": "ring", "ring": {"purposes": ["grad_bucket"]}})


def test_registered_records_name_their_config_classes() -> None:
    records = {r.name: r for r in CollectivesPlugin().plait_register_comm_algorithms()}
    assert set(records) == {"ring", "tree", "hierarchical"}
    assert records["ring"].ops == ("all_reduce", "reduce_scatter")
    assert records["hierarchical"].ops == ("all_reduce", "reduce_scatter", "all_gather")
    assert records["tree"].config_cls is TreeConfig


def test_axis_rank_sets_follow_the_mesh_layout() -> None:
    # Mesh axes are (pp, dp, cp, tp), row-major: tp varies fastest.
    degrees = {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
    assert axis_rank_sets(degrees, "dp") == [(0, 2), (1, 3)]
    assert axis_rank_sets(degrees, "tp") == [(0, 1), (2, 3)]
    degrees = {"pp": 2, "dp": 3, "cp": 1, "tp": 1}
    assert axis_rank_sets(degrees, "dp") == [(0, 1, 2), (3, 4, 5)]
    assert axis_rank_sets(degrees, "pp") == [(0, 3), (1, 4), (2, 5)]


def test_a_group_without_a_dedicated_mirror_runs_inline_and_is_complete() -> None:
    runner = AlgorithmRunner("demo")
    ran: list[Group] = []
    work = runner.run(_request(async_op=True), lambda comm, group: ran.append(group), comm=None)  # type: ignore[arg-type]
    assert isinstance(work, CompletedWork)
    assert ran == [Group(name="world", ranks=(0, 1))]


def test_sub_purposes_are_never_taken_over_again() -> None:
    assert sub_purpose("ring", GRAD_BUCKET) == "ring/grad_bucket"
    assert is_sub_op("param_server/grad_bucket/push")
    assert not is_sub_op(GRAD_BUCKET)


def test_every_purpose_plait_issues_is_a_published_constant() -> None:
    root = Path(__file__).resolve().parents[2]
    literals = set()
    for folder in ("core", "plugins"):
        for path in (root / folder).rglob("*.py"):
            literals |= set(re.findall(r'purpose="([a-z_]+)"', path.read_text()))
    assert literals <= PURPOSES, sorted(literals - PURPOSES)
