"""α–β cost of collectives per group, and its calibration from the daemon's comm spans.

A message of `n` bytes over one link takes `α + n/β`. Ring collectives over a group of `g`
ranks, `S` the bytes of the full buffer (all-reduce input, all-gather output, reduce-scatter
input), take (Thakur, Rabenseifner & Gropp 2005; NCCL's "bus bandwidth"):

    all_reduce       2(g-1)·α + 2(g-1)/g · S/β
    all_gather       (g-1)·α  + (g-1)/g · S/β      (reduce_scatter, all_to_all alike)
    send / recv      α + S/β

A group uses the intra-node link when all its ranks share a node (Megatron's rank order: tp
fastest, then cp, dp, pp; a group of `g` ranks `stride` apart spans `g·stride` consecutive
ranks), the inter-node link otherwise.

`fit_links` fits α and β per link kind by least squares to recorded spans (`CommSample`: op,
bytes, group size, seconds, intra-node or not): each span is one equation
`seconds = α·steps(op, g) + volume(op, g, S) · (1/β)`, linear in (α, 1/β). Each collective
family seen at two or more sizes also gets its own α–β (`Link.by_op`): backends implement each
with its own algorithm, and one pair for all of them prices some several times off.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from plait.core.host import cache_dir
from plait.planner.devices import DeviceSpec, Link, OpLink

RING_OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")
P2P_OPS = ("send", "recv", "isend", "irecv")


def steps_and_volume(op: str, group: int, nbytes: float) -> tuple[float, float]:
    """(latency terms, bytes through the slowest link) of one collective."""
    if op in P2P_OPS or group <= 1:
        return (1.0, nbytes) if op in P2P_OPS else (0.0, 0.0)
    share = (group - 1) / group
    if op == "all_reduce":
        return 2.0 * (group - 1), 2.0 * share * nbytes
    if op == "broadcast":
        return float(group - 1), nbytes
    return float(group - 1), share * nbytes


def op_family(op: str) -> str:
    """The collective an op is priced as: point-to-point ops share one fit."""
    return "send" if op in P2P_OPS else op


def collective_seconds(op: str, group: int, nbytes: float, link: Link) -> float:
    steps, volume = steps_and_volume(op, group, nbytes)
    alpha, beta = link.for_op(op_family(op))
    return steps * alpha + volume / beta


def group_is_intra_node(size: int, stride: int, per_node: int) -> bool:
    return size * stride <= per_node


def link_for(device: DeviceSpec, *, size: int, stride: int, per_node: int) -> Link:
    intra = group_is_intra_node(size, stride, per_node)
    return device.intra_node if intra else device.inter_node


@dataclass(frozen=True, slots=True, kw_only=True)
class CommSample:
    op: str
    nbytes: float
    group: int
    seconds: float
    intra_node: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class OpFit:
    """One collective family's own α–β on a link."""

    op: str
    alpha: float
    beta: float
    samples: int
    rms_error_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkFit:
    alpha: float
    beta: float
    samples: int
    rms_error_seconds: float
    by_op: tuple[OpFit, ...] = ()  # families with spans at two or more sizes

    def link(self) -> Link:
        return Link(
            alpha=self.alpha,
            beta=self.beta,
            by_op=tuple(OpLink(op=f.op, alpha=f.alpha, beta=f.beta) for f in self.by_op),
        )

    @classmethod
    def from_json(cls, data: dict) -> LinkFit:
        by_op = tuple(OpFit(**entry) for entry in data.get("by_op", ()))
        return cls(**{**data, "by_op": by_op})


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkCalibration:
    """Fitted links, as `plait plan calibrate` writes them (`None`: no spans of that kind)."""

    intra: LinkFit | None
    inter: LinkFit | None
    source: str
    measured_at: float

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, path: Path) -> LinkCalibration:
        data = json.loads(path.read_text())
        return cls(
            intra=LinkFit.from_json(data["intra"]) if data.get("intra") else None,
            inter=LinkFit.from_json(data["inter"]) if data.get("inter") else None,
            source=str(data.get("source", "")),
            measured_at=float(data.get("measured_at", 0.0)),
        )


def default_calibration_path() -> Path:
    return cache_dir() / "plan-links.json"


Row = tuple[float, float, float]  # (latency terms, volume, seconds)


def _rows(samples: Sequence[CommSample]) -> list[Row]:
    return [
        (*steps_and_volume(s.op, s.group, s.nbytes), s.seconds)
        for s in samples
        if s.seconds > 0 and (s.op in P2P_OPS or (s.op in RING_OPS and s.group > 1))
    ]


def _least_squares(rows: Sequence[Row]) -> tuple[float, float, float]:
    """(α, 1/β, rms error) of `seconds = α·a + v·(1/β)` over `rows`."""
    # Normal equations weighted by 1/seconds² so that small and large messages count alike
    # (relative error), then clamped to physical values.
    saa = sav = svv = sat = svt = 0.0
    for a, v, t in rows:
        w = 1.0 / (t * t)
        saa += w * a * a
        sav += w * a * v
        svv += w * v * v
        sat += w * a * t
        svt += w * v * t
    det = saa * svv - sav * sav
    if abs(det) < 1e-30 * max(saa * svv, 1e-300):
        alpha, inv_beta = 0.0, svt / svv if svv else 0.0
    else:
        alpha = (sat * svv - svt * sav) / det
        inv_beta = (saa * svt - sav * sat) / det
    if alpha < 0:  # latency cannot be negative: refit bandwidth alone
        alpha, inv_beta = 0.0, svt / svv
    if inv_beta <= 0:  # nothing bandwidth-bound in the sample: latency alone
        inv_beta = 1e-15
        alpha = sat / saa if saa else 0.0
    errors = [(alpha * a + v * inv_beta - t) ** 2 for a, v, t in rows]
    return alpha, inv_beta, (sum(errors) / len(errors)) ** 0.5


def _fit(samples: Sequence[CommSample]) -> LinkFit | None:
    rows = _rows(samples)
    if len(rows) < 2:
        return None
    alpha, inv_beta, rms = _least_squares(rows)
    families: dict[str, list[CommSample]] = {}
    for sample in samples:
        families.setdefault(op_family(sample.op), []).append(sample)
    by_op = []
    for op, members in sorted(families.items()):
        own = _rows(members)
        # α and β apart need two message sizes; a family seen at one size keeps the shared fit
        if len({volume for _, volume, _ in own}) < 2:
            continue
        op_alpha, op_inv_beta, op_rms = _least_squares(own)
        by_op.append(
            OpFit(op=op, alpha=op_alpha, beta=1.0 / op_inv_beta, samples=len(own),
                  rms_error_seconds=op_rms)
        )  # fmt: skip
    return LinkFit(
        alpha=alpha,
        beta=1.0 / inv_beta,
        samples=len(rows),
        rms_error_seconds=rms,
        by_op=tuple(by_op),
    )


def fit_links(samples: Iterable[CommSample], *, source: str = "") -> LinkCalibration:
    samples = list(samples)
    return LinkCalibration(
        intra=_fit([s for s in samples if s.intra_node]),
        inter=_fit([s for s in samples if not s.intra_node]),
        source=source,
        measured_at=time.time(),
    )
