"""Ring and halving-doubling all-reduce on an in-memory network of threads, plus selection logic.

Each rank is a thread; a send puts a copy on the (src, dst) queue and a receive takes from it, in
order, the way Gloo matches point-to-point messages. This checks every group size 1-8 and odd
tensor sizes in a second, without spawning processes; tests/dist checks the same code on Gloo.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from plait.core.comm import CompletedWork, Group
from plait.core.config import load_config
from plait.core.engine import check_config
from plait.core.errors import ConfigError, PluginError
from plait.core.plugins import Plugins
from plait.core.records import CommRequest
from plait.plugins.collectives import CollectivesPlugin
from plait.plugins.collectives.config import check_algorithm
from plait.plugins.collectives.ring import ring_all_reduce
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
    for name in ("ring", "tree_halving"):
        algorithm, kwargs = ALGORITHMS[name]
        _, network = run_all_reduce(algorithm, inputs, "sum", **kwargs)
        assert network.sent_elements == [optimal] * world_size, name
    # Recursive doubling trades bandwidth for fewer steps: the whole vector, log2(p) times.
    algorithm, kwargs = ALGORITHMS["tree_doubling"]
    _, network = run_all_reduce(algorithm, inputs, "sum", **kwargs)
    steps = world_size.bit_length() - 1
    assert network.sent_elements == [steps * numel] * world_size


def _request(op: str = "all_reduce", purpose: str = "grad_bucket") -> CommRequest:
    return CommRequest(
        op=op,  # type: ignore[arg-type]
        tensors=(torch.ones(3),),
        group=None,
        group_name="world",
        group_ranks=(0, 1),
        seq=0,
        purpose=purpose,
    )


def test_plugin_takes_over_only_what_it_is_configured_for() -> None:
    plugin = CollectivesPlugin()
    assert plugin.plait_communicate(request=_request()) is None  # algorithm = "torch"

    plugin.plait_configure(config=load_config({"comm": {"algorithm": "ring"}}))
    assert plugin.config.algorithm == "ring"
    assert plugin.plait_communicate(request=_request(op="broadcast")) is None
    assert plugin.plait_communicate(request=_request(purpose="ring/grad_bucket")) is None
    with pytest.raises(PluginError, match="bind"):
        plugin.plait_communicate(request=_request())

    config = load_config({"comm": {"algorithm": "tree", "tree": {"purposes": ["activation"]}}})
    plugin.plait_configure(config=config)
    assert plugin.plait_communicate(request=_request(purpose="grad_bucket")) is None


def test_config_errors_name_the_field_and_the_alternatives() -> None:
    plugins = Plugins.create(autoload=False)
    with pytest.raises(ConfigError, match=r"comm\.powersgd\.rank"):
        check_config(load_config({"comm": {"powersgd": {"rank": 0}}}), plugins, with_model=False)
    with pytest.raises(ConfigError, match=r"comm\.topk\.ratios"):
        check_config(load_config({"comm": {"topk": {"ratios": 0.1}}}), plugins, with_model=False)
    with pytest.raises(ConfigError, match=r"comm\.anything: not a field"):
        check_config(load_config({"comm": {"anything": 1}}), plugins, with_model=False)
    check_algorithm("ring", {"ring": None, "tree": None})
    check_algorithm("torch", {})
    with pytest.raises(ConfigError, match=r"'rnig'.*ring, torch, tree"):
        check_algorithm("rnig", {"ring": None, "tree": None})


def test_registered_records_name_their_config_classes() -> None:
    records = {r.name: r for r in CollectivesPlugin().plait_register_comm_algorithms()}
    assert set(records) == {"ring", "tree"}
    assert records["ring"].ops == ("all_reduce",)
    assert records["tree"].config_cls is not None
