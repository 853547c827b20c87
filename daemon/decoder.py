"""The door: every attribute the daemon reads is decoded here, typed and range-checked.

OTLP attributes are untyped on the wire (`AnyValue`), and any producer may send anything. The
receivers turn each resource and each span into a typed record through this module and nothing
else; a value of the wrong type or out of range raises `Rejected`, naming the attribute and
why, and the receiver rejects that item alone (OTLP partial success). Everything downstream
(store, MFU, bottlenecks, hangs, exporters) reads only typed fields of records that passed, so
no later computation can divide by zero or fail to convert on received data.

Rules, written once in the `_read_*` helpers:

* integers are `int_value`s (a `double_value` with an integral value is accepted, since some
  SDKs send every number as a double); booleans are never integers;
* floats are `int_value`s or `double_value`s, finite unless stated otherwise;
* strings are `string_value`s; booleans are `bool_value`s;
* integers that end up in `int32` proto fields (ranks, sizes, mesh coordinates) fit in int32,
  every other integer in int64.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from plait.daemon import telemetry_schema as schema

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1
# The last 0-based step a rank may send: reports show steps completed (`plait.step` + 1), an
# int64 field, so the step after it must fit too.
MAX_WIRE_STEP = INT64_MAX - 1
MAX_VALUE_REPR = 40

# (job id, replica group, rank): a fault-tolerant job's groups are worlds of their own, each with
# its ranks 0..n-1; -1 for a rank of no replica group.
RankKey = tuple[str, int, int]


class Rejected(ValueError):
    """An item failed decoding: `attribute` is the name at fault, `reason` a short class."""

    def __init__(self, attribute: str, reason: str, detail: str) -> None:
        super().__init__(f"{attribute}: {detail}")
        self.attribute = attribute
        self.reason = reason
        self.detail = detail

    @property
    def key(self) -> str:
        """What the reject counters are keyed by: "plait.world_size: out of range"."""
        return f"{self.attribute}: {self.reason}"

    def detached(self) -> Rejected:
        """The same rejection, never raised: to keep after its `except` block.

        NOTE: a raised exception's traceback holds the frames it passed through, and they hold
        whatever keeps the exception (a decoded request, with the call that carried it): a
        reference cycle that only the cyclic collector reclaims, and while the daemon serves it
        collects every ten minutes (`plait.daemon.interpreter`)."""
        return Rejected(self.attribute, self.reason, self.detail)


WRONG_TYPE = "wrong type"
OUT_OF_RANGE = "out of range"
NOT_FINITE = "not finite"
MISSING = "missing"
INCONSISTENT = "inconsistent"


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= MAX_VALUE_REPR else text[: MAX_VALUE_REPR - 3] + "..."


def _one_of(attributes: Any, name: str, allowed: tuple[str, ...]) -> str:
    """A required string attribute that must be one of `allowed`, else the span is rejected."""
    value = read_str(attributes, name, required=True)
    if value not in allowed:
        raise Rejected(name, OUT_OF_RANGE, f"{_shown(value)} is not one of {', '.join(allowed)}")
    return value


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Rejected(name, WRONG_TYPE, f"expected an integer, got {_shown(value)}")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            raise Rejected(name, WRONG_TYPE, f"expected an integer, got {_shown(value)}")
        value = int(value)
    return value


def read_int(
    attributes: Mapping[str, Any],
    name: str,
    default: int | None = None,
    *,
    low: int = 0,
    high: int = INT64_MAX,
) -> int:
    """An integer attribute in [low, high]; `default` when absent (None: required)."""
    value = attributes.get(name)
    if type(value) is int and low <= value <= high:  # the common case, decided at once
        return value
    if name not in attributes:
        if default is None:
            raise Rejected(name, MISSING, "required attribute is missing")
        return default
    value = _as_int(name, attributes[name])
    if not low <= value <= high:
        raise Rejected(name, OUT_OF_RANGE, f"{value} is outside [{low}, {high}]")
    return value


def read_float(
    attributes: Mapping[str, Any],
    name: str,
    default: float = 0.0,
    *,
    low: float = 0.0,
    finite: bool = True,
) -> float:
    """A float attribute, finite (unless `finite=False`) and >= low; `default` when absent."""
    value = attributes.get(name)
    if type(value) is float and (not finite or (math.isfinite(value) and value >= low)):
        return value  # the common case, decided at once
    if name not in attributes:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise Rejected(name, WRONG_TYPE, f"expected a number, got {_shown(value)}")
    value = float(value)
    if not finite:
        return value
    if not math.isfinite(value):
        raise Rejected(name, NOT_FINITE, f"expected a finite number, got {value}")
    if value < low:
        raise Rejected(name, OUT_OF_RANGE, f"{value} is below {low}")
    return value


def read_str(
    attributes: Mapping[str, Any], name: str, default: str = "", *, required: bool = False
) -> str:
    value = attributes.get(name)
    if type(value) is str and (value or not required):  # the common case
        return value
    if name not in attributes:
        if required:
            raise Rejected(name, MISSING, "required attribute is missing")
        return default
    value = attributes[name]
    if not isinstance(value, str):
        raise Rejected(name, WRONG_TYPE, f"expected a string, got {_shown(value)}")
    if required and not value:
        raise Rejected(name, OUT_OF_RANGE, "must not be empty")
    return value


def read_bool(attributes: Mapping[str, Any], name: str, default: bool = False) -> bool:
    value = attributes.get(name)
    if type(value) is bool:
        return value
    if name not in attributes:
        return default
    value = attributes[name]
    if not isinstance(value, bool):
        raise Rejected(name, WRONG_TYPE, f"expected a boolean, got {_shown(value)}")
    return value


def read_int_list(
    attributes: Mapping[str, Any], name: str, *, high: int = INT32_MAX
) -> tuple[int, ...]:
    value = attributes.get(name)
    if type(value) is list and all(type(v) is int and 0 <= v <= high for v in value):
        return tuple(value)  # the common case, decided at once
    if name not in attributes:
        return ()
    if not isinstance(value, list | tuple):
        raise Rejected(name, WRONG_TYPE, f"expected a list of integers, got {_shown(value)}")
    out = []
    for item in value:
        number = _as_int(name, item)
        if not 0 <= number <= high:
            raise Rejected(name, OUT_OF_RANGE, f"{number} is outside [0, {high}]")
        out.append(number)
    return tuple(out)


# --------------------------------------------------------------------------------------------
# resources
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """Who a rank is, from its resource attributes (decoded by `decode_resource`)."""

    job_id: str
    rank: int
    local_rank: int
    world_size: int
    host: str
    pid: int
    device: str
    device_name: str
    compute_dtype: str
    peak_flops: float
    peak_flops_source: str
    model_name: str
    num_params: int
    coordinates: dict[str, int]
    degrees: dict[str, int]
    restart_attempt: int = 0
    replica_group: int = schema.NO_REPLICA_GROUP

    @property
    def key(self) -> RankKey:
        return (self.job_id, self.replica_group, self.rank)

    @classmethod
    def from_resource(cls, attributes: Mapping[str, Any]) -> RankIdentity | None:
        """`None` for a resource that is not a plait rank; raises `Rejected` for a bad one."""
        return decode_resource(attributes)


def is_rank_resource(attributes: Mapping[str, Any]) -> bool:
    """A resource claims to be a plait rank when it names a job or a rank."""
    return schema.RESOURCE_JOB_ID in attributes or schema.RESOURCE_RANK in attributes


def _mesh(attributes: Mapping[str, Any], prefix: str, low: int) -> dict[str, int]:
    return {
        key[len(prefix) :]: read_int(attributes, key, low=low, high=INT32_MAX)
        for key in attributes
        if key.startswith(prefix)
    }


def decode_resource(attributes: Mapping[str, Any]) -> RankIdentity | None:
    """A rank's identity; None when the resource is not a rank; `Rejected` when it is bad."""
    if not is_rank_resource(attributes):
        return None
    job_id = read_str(attributes, schema.RESOURCE_JOB_ID, required=True)
    world_size = read_int(attributes, schema.RESOURCE_WORLD_SIZE, 1, low=1, high=INT32_MAX)
    # A rank or local rank at or past the world size would make every per-rank share wrong.
    rank = read_int(attributes, schema.RESOURCE_RANK, high=world_size - 1)
    local_rank = read_int(attributes, schema.RESOURCE_LOCAL_RANK, 0, high=world_size - 1)
    degrees = _mesh(attributes, schema.RESOURCE_MESH_DEGREE_PREFIX, low=1)
    coordinates = _mesh(attributes, schema.RESOURCE_MESH_COORD_PREFIX, low=0)
    for axis, coordinate in coordinates.items():
        degree = degrees.get(axis)
        if degree is not None and coordinate >= degree:
            raise Rejected(
                schema.RESOURCE_MESH_COORD_PREFIX + axis,
                OUT_OF_RANGE,
                f"{coordinate} is not below the axis degree {degree}",
            )
    # Read for validation only: producers that send them must send them well-formed.
    read_float(attributes, schema.RESOURCE_FLOPS_PER_TOKEN)
    read_int(attributes, schema.RESOURCE_TOKENS_PER_STEP, 0)
    return RankIdentity(
        job_id=job_id,
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        host=read_str(attributes, schema.RESOURCE_HOST_NAME),
        pid=read_int(attributes, schema.RESOURCE_PROCESS_PID, 0),
        device=read_str(attributes, schema.RESOURCE_DEVICE),
        device_name=read_str(attributes, schema.RESOURCE_DEVICE_NAME),
        compute_dtype=read_str(attributes, schema.RESOURCE_COMPUTE_DTYPE),
        peak_flops=read_float(attributes, schema.RESOURCE_PEAK_FLOPS),
        peak_flops_source=read_str(attributes, schema.RESOURCE_PEAK_FLOPS_SOURCE),
        model_name=read_str(attributes, schema.RESOURCE_MODEL_NAME),
        num_params=read_int(attributes, schema.RESOURCE_NUM_PARAMS, 0),
        coordinates=coordinates,
        degrees=degrees,
        restart_attempt=read_int(attributes, schema.RESOURCE_RESTART_ATTEMPT, 0, high=INT32_MAX),
        replica_group=read_int(
            attributes,
            schema.RESOURCE_REPLICA_GROUP,
            schema.NO_REPLICA_GROUP,
            low=schema.NO_REPLICA_GROUP,
            high=INT32_MAX,
        ),
    )


# --------------------------------------------------------------------------------------------
# spans
# --------------------------------------------------------------------------------------------


@dataclass(slots=True)  # not frozen: frozen __init__ costs ~1 µs per span at the door
class StepFigures:
    """What a step span reports (job-wide figures for this step)."""

    tokens: int
    model_flops: float
    data_wait_seconds: float
    loss: float


@dataclass(slots=True)  # not frozen: frozen __init__ costs ~1 µs per span at the door
class CommFigures:
    """What a comm span reports."""

    op: str
    purpose: str
    blocking: bool
    nbytes: int
    group: str
    algorithm: str = ""  # what carried the op out ("torch": the backend), "" unknown
    bytes_intra_node: int = 0  # sent inside the rank's node (0 when the span says nothing)
    bytes_inter_node: int = 0  # sent across nodes

    @property
    def on_the_wire(self) -> bool:
        """The backend carried the op out: its link bytes are bytes on the wire, counted once
        (an algorithm's own op is not: its sub-ops are)."""
        return self.algorithm == schema.COMM_ALGORITHM_BACKEND


@dataclass(frozen=True, slots=True)
class ExpertLoadFigures:
    """What an expert-load span reports: one MoE layer, one step, the whole job."""

    layer: str
    tokens_per_expert: tuple[int, ...]
    dropped: int


@dataclass(frozen=True, slots=True)
class QuorumFigures:
    """What a quorum-event span reports: one change of the job's quorum as the sending replica
    group saw it (`plait.daemon.telemetry_schema.QUORUM_EVENTS`)."""

    event: str
    quorum_id: int
    participants: int
    previous: int
    detail: str = ""
    replica_id: str = ""


# A failed save's error as the daemon keeps it: its first line, at most this long.
MAX_CHECKPOINT_ERROR = 300


@dataclass(frozen=True, slots=True)
class CheckpointFigures:
    """What a checkpoint-save span reports (`plait.daemon.telemetry_schema.CHECKPOINT_OUTCOMES`):
    a save that started (an instant), or one that ended, saved or failed, timed over its write."""

    step: int  # steps done: the checkpoint's `step-N`
    asynchronous: bool
    outcome: str
    blocked_seconds: float = 0.0  # what the training step waited
    write_seconds: float = 0.0
    nbytes: int = -1  # the files written (-1: unknown)
    error: str = ""


@dataclass(slots=True)  # not frozen: frozen __init__ costs ~1 µs per span at the door
class SpanRecord:
    """One received span. `kind` is one of the `telemetry_schema.SPAN_KIND_*`."""

    name: str
    kind: str
    start_ns: int
    end_ns: int
    step: int | None
    attributes: dict[str, Any]
    error: bool = False
    step_figures: StepFigures | None = None
    comm: CommFigures | None = None
    phase: str = ""
    outcome: str = ""  # job_end spans: one of schema.JOB_OUTCOMES
    expert_load: ExpertLoadFigures | None = None
    quorum: QuorumFigures | None = None
    checkpoint: CheckpointFigures | None = None

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9

    @classmethod
    def classify(
        cls, name: str, start_ns: int, end_ns: int, attributes: dict[str, Any], error: bool
    ) -> SpanRecord:
        """The decoded span; raises `Rejected` for a bad one."""
        return decode_span(name, start_ns, end_ns, attributes, error)


SPAN_TIME = "span.end_time_unix_nano"


@dataclass(frozen=True, slots=True)
class SpanStatics:
    """What a span's name, strings, booleans and lists decide: its kind and the figures that
    repeat from span to span (a collective's op, purpose and group, a phase's name). Decoded
    once per distinct set of them (`StaticsCache`); the numbers are read per span."""

    kind: str
    comm: tuple[str, str, bool, str] | None = None  # op, purpose, blocking, group
    algorithm: str = ""  # a comm span's plait.comm.algorithm
    phase: str = ""
    outcome: str = ""
    expert_layer: str = ""
    tokens_per_expert: tuple[int, ...] = ()
    quorum: tuple[str, str, str] = ("", "", "")  # event, detail, replica id
    checkpoint: tuple[str, bool, str] = ("", False, "")  # outcome, asynchronous, error


def span_statics(name: str, attributes: Mapping[str, Any]) -> SpanStatics:
    """The span's kind and non-number figures; raises `Rejected` for a bad one."""
    kind = schema.classify_span(name, attributes)  # type: ignore[arg-type]
    if kind == schema.SPAN_KIND_COMM:
        comm = (
            read_str(attributes, schema.SPAN_COMM_OP, required=True),
            read_str(attributes, schema.SPAN_COMM_PURPOSE),
            not read_bool(attributes, schema.SPAN_COMM_ASYNC),
            read_str(attributes, schema.SPAN_COMM_GROUP),
        )
        read_int_list(attributes, schema.SPAN_COMM_GROUP_RANKS)
        algorithm = read_str(attributes, schema.SPAN_COMM_ALGORITHM)
        return SpanStatics(kind, comm=comm, algorithm=algorithm)
    if kind == schema.SPAN_KIND_PHASE:
        return SpanStatics(kind, phase=read_str(attributes, schema.SPAN_PHASE))
    if kind == schema.SPAN_KIND_JOB_END:
        outcome = _one_of(attributes, schema.SPAN_JOB_OUTCOME, schema.JOB_OUTCOMES)
        return SpanStatics(kind, outcome=outcome)
    if kind == schema.SPAN_KIND_EXPERT_LOAD:
        layer = read_str(attributes, schema.SPAN_MOE_LAYER, required=True)
        tokens = read_int_list(attributes, schema.SPAN_MOE_TOKENS_PER_EXPERT, high=INT64_MAX)
        if not tokens:
            raise Rejected(schema.SPAN_MOE_TOKENS_PER_EXPERT, MISSING, "no experts listed")
        if sum(tokens) > INT64_MAX:  # reported as the layer's total, an int64
            raise Rejected(
                schema.SPAN_MOE_TOKENS_PER_EXPERT, OUT_OF_RANGE, f"the sum exceeds {INT64_MAX}"
            )
        return SpanStatics(kind, expert_layer=layer, tokens_per_expert=tokens)
    if kind == schema.SPAN_KIND_QUORUM:
        event = _one_of(attributes, schema.SPAN_QUORUM_EVENT, schema.QUORUM_EVENTS)
        detail = read_str(attributes, schema.SPAN_QUORUM_DETAIL)
        return SpanStatics(
            kind, quorum=(event, detail, read_str(attributes, schema.SPAN_REPLICA_ID))
        )
    if kind == schema.SPAN_KIND_CHECKPOINT:
        outcome = _one_of(attributes, schema.SPAN_CHECKPOINT_OUTCOME, schema.CHECKPOINT_OUTCOMES)
        error = read_str(attributes, schema.SPAN_CHECKPOINT_ERROR)
        first_line = error.strip().split("\n", 1)[0][:MAX_CHECKPOINT_ERROR] if error else ""
        asynchronous = read_bool(attributes, schema.SPAN_CHECKPOINT_ASYNC)
        return SpanStatics(kind, checkpoint=(outcome, asynchronous, first_line))
    return SpanStatics(kind)


# What a `SpanRecord` is made of, in its field order, with its figures as plain tuples: what an
# ingest worker sends the daemon (`plait.daemon.ingest`), and what `span_record` builds from.
SpanFields = tuple[Any, ...]


def decode_span_fields(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any],
    error: bool = False,
    statics: SpanStatics | None = None,
) -> SpanFields:
    """A span of a rank, classified (`telemetry_schema.classify_span`) and decoded, as
    `SpanFields`; raises `Rejected` for a bad one.

    `statics`: what `span_statics` returned for a span with the same name and the same
    attributes except numbers (`StaticsCache`); decoded here when not given."""
    if end_ns < start_ns:
        raise Rejected(SPAN_TIME, OUT_OF_RANGE, f"ends before it starts ({end_ns} < {start_ns})")
    if statics is None:
        statics = span_statics(name, attributes)
    kind = statics.kind
    step = read_int(attributes, schema.SPAN_STEP, -1, high=MAX_WIRE_STEP)
    figures = comm = expert_load = quorum = checkpoint = None
    if kind == schema.SPAN_KIND_STEP:
        figures = (  # StepFigures
            read_int(attributes, schema.SPAN_STEP_TOKENS, 0),
            read_float(attributes, schema.SPAN_STEP_MODEL_FLOPS),
            read_float(attributes, schema.SPAN_STEP_DATA_WAIT),
            # NOTE: a diverging run reports NaN or inf losses; keep its step (and its MFU).
            read_float(attributes, schema.SPAN_STEP_LOSS, finite=False),
        )
    elif statics.comm is not None:
        op, purpose, blocking, group = statics.comm
        comm = (  # CommFigures
            op,
            purpose,
            blocking,
            read_int(attributes, schema.SPAN_COMM_BYTES, 0),
            group,
            statics.algorithm,
            read_int(attributes, schema.SPAN_COMM_BYTES_INTRA_NODE, 0),
            read_int(attributes, schema.SPAN_COMM_BYTES_INTER_NODE, 0),
        )
        read_int(attributes, schema.SPAN_COMM_SEQ, 0)
        read_int(attributes, schema.SPAN_COMM_PEER, 0, high=INT32_MAX)
    elif kind == schema.SPAN_KIND_EXPERT_LOAD:
        expert_load = (  # ExpertLoadFigures
            statics.expert_layer,
            statics.tokens_per_expert,
            read_int(attributes, schema.SPAN_MOE_DROPPED, 0),
        )
    elif kind == schema.SPAN_KIND_QUORUM:
        event, detail, replica_id = statics.quorum
        quorum = (  # QuorumFigures
            event,
            read_int(attributes, schema.SPAN_QUORUM_ID, 0),
            read_int(attributes, schema.SPAN_QUORUM_PARTICIPANTS, 0, high=INT32_MAX),
            read_int(attributes, schema.SPAN_QUORUM_PREVIOUS, 0, high=INT32_MAX),
            detail,
            replica_id,
        )
    elif kind == schema.SPAN_KIND_CHECKPOINT:
        outcome, asynchronous, error = statics.checkpoint
        checkpoint = (  # CheckpointFigures
            read_int(attributes, schema.SPAN_CHECKPOINT_STEP),
            asynchronous,
            outcome,
            read_float(attributes, schema.SPAN_CHECKPOINT_BLOCKED),
            read_float(attributes, schema.SPAN_CHECKPOINT_WRITE),
            read_int(attributes, schema.SPAN_CHECKPOINT_BYTES, -1),
            error,
        )
    return (
        name,
        kind,
        start_ns,
        end_ns,
        step if step >= 0 else None,
        attributes,
        error,
        figures,
        comm,
        statics.phase,
        statics.outcome,
        expert_load,
        quorum,
        checkpoint,
    )


def span_record(fields: SpanFields) -> SpanRecord:
    (name, kind, start_ns, end_ns, step, attributes, error, figures, comm, phase, outcome, load,
     quorum, checkpoint) = fields  # fmt: skip
    return SpanRecord(
        name,
        kind,
        start_ns,
        end_ns,
        step,
        attributes,
        error,
        None if figures is None else StepFigures(*figures),
        None if comm is None else CommFigures(*comm),
        phase,
        outcome,
        None if load is None else ExpertLoadFigures(*load),
        None if quorum is None else QuorumFigures(*quorum),
        None if checkpoint is None else CheckpointFigures(*checkpoint),
    )


def decode_span(
    name: str,
    start_ns: int,
    end_ns: int,
    attributes: dict[str, Any],
    error: bool = False,
    statics: SpanStatics | None = None,
) -> SpanRecord:
    """A span of a rank, classified and decoded (`decode_span_fields`)."""
    return span_record(decode_span_fields(name, start_ns, end_ns, attributes, error, statics))


MAX_CACHED_STATICS = 65536


class StaticsCache:
    """`SpanStatics` by span shape: spans of one shape (`plait.daemon.otlp_wire.WireSpan.shape`)
    have the same name and the same attributes except numbers, so they decide the same statics.

    NOTE: decoding the strings, booleans and lists of a collective's span costs several µs of
    Python, more than everything else at the door; plait's ranks send the same ones in every
    step. Statics that fail to decode are never cached: each span of a bad shape is rejected."""

    def __init__(self, capacity: int = MAX_CACHED_STATICS) -> None:
        self.capacity = capacity
        self._by_shape: dict[Any, SpanStatics] = {}

    def decode(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any],
        error: bool,
        shape: Any,
    ) -> SpanRecord:
        return span_record(self.decode_fields(name, start_ns, end_ns, attributes, error, shape))

    def decode_fields(
        self,
        name: str,
        start_ns: int,
        end_ns: int,
        attributes: dict[str, Any],
        error: bool,
        shape: Any,
    ) -> SpanFields:
        if shape is None:
            return decode_span_fields(name, start_ns, end_ns, attributes, error)
        statics = self._by_shape.get(shape)
        if statics is None:
            statics = span_statics(name, attributes)
            if len(self._by_shape) < self.capacity:
                self._by_shape[shape] = statics
        return decode_span_fields(name, start_ns, end_ns, attributes, error, statics)


# --------------------------------------------------------------------------------------------
# metric points
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GaugePoint:
    """A decoded heartbeat gauge point."""

    name: str
    value: float
    group: str = ""
    group_ranks: tuple[int, ...] = ()
    op: str = ""
    seq: int = -1
    purpose: str = ""


# Heartbeat values become nanosecond times and sequence numbers: keep them where int64 can hold
# them after scaling (Unix seconds well past year 2200).
MAX_HEARTBEAT_VALUE = 9.0e9


def decode_heartbeat_point(name: str, attributes: Mapping[str, Any], value: float) -> GaugePoint:
    if not math.isfinite(value) or not 0 <= value <= MAX_HEARTBEAT_VALUE:
        raise Rejected(name, OUT_OF_RANGE, f"value {value} is not a time or sequence number")
    if name == schema.METRIC_COMM_HEARTBEAT:
        return GaugePoint(name, value)
    return GaugePoint(
        name,
        value,
        group=read_str(attributes, schema.SPAN_COMM_GROUP),
        group_ranks=read_int_list(attributes, schema.SPAN_COMM_GROUP_RANKS),
        op=read_str(attributes, schema.SPAN_COMM_OP),
        seq=read_int(attributes, schema.SPAN_COMM_SEQ, -1, low=-1),
        purpose=read_str(attributes, schema.SPAN_COMM_PURPOSE),
    )


# Metrics whose latest value the daemon converts or reports as a typed field, and their range.
BOUNDED_METRICS: dict[str, tuple[float, float]] = {
    schema.METRIC_DEVICE_MEMORY_USED: (0.0, float(INT64_MAX // 2)),
}


def check_metric_value(name: str, value: float) -> None:
    """Values of metrics in `BOUNDED_METRICS` must be finite and in range; others are kept as
    they are (NaN and inf are valid doubles in `otel_metrics` and Prometheus)."""
    bounds = BOUNDED_METRICS.get(name)
    if bounds is None:
        return
    if not (math.isfinite(value) and bounds[0] <= value <= bounds[1]):
        raise Rejected(name, OUT_OF_RANGE, f"value {value} is outside [{bounds[0]}, {bounds[1]}]")


@dataclass
class RejectCounts:
    """Rejected spans and data points, by reason ("plait.rank: out of range")."""

    spans: int = 0
    metric_points: int = 0
    by_reason: dict[str, int] = field(default_factory=dict)

    def add(self, rejected: Rejected, *, spans: int = 0, metric_points: int = 0) -> None:
        self.spans += spans
        self.metric_points += metric_points
        self.by_reason[rejected.key] = self.by_reason.get(rejected.key, 0) + spans + metric_points
