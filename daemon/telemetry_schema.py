"""The telemetry wire schema: every attribute, span and metric name a rank sends the daemon.

This module is the published contract between producers (plait's ranks, or any OpenTelemetry
SDK configured by hand) and the node daemon. It imports nothing, so a producer can vendor it.
docs/telemetry-schema.md documents every constant here (a test checks it).

A rank is an OpenTelemetry *resource* carrying `RESOURCE_*` attributes; the daemon keys it by
(`plait.job.id`, `plait.rank`). Spans carry `SPAN_*` attributes and are classified by
`classify_span`. Metrics are read by name (`METRIC_*`). A fault-tolerant job's replica groups
are torchrun worlds of their own that share the job id: their ranks also carry
`plait.replica_group`, and the daemon keys them by (`plait.job.id`, `plait.replica_group`,
`plait.rank`).
"""

from __future__ import annotations

# --------------------------------------------------------------------------------------------
# resource attributes (who the rank is)
# --------------------------------------------------------------------------------------------

RESOURCE_JOB_ID = "plait.job.id"  # str, non-empty
RESOURCE_RANK = "plait.rank"  # int, 0 <= rank < world_size
RESOURCE_LOCAL_RANK = "plait.local_rank"  # int, 0 <= local_rank < world_size
RESOURCE_WORLD_SIZE = "plait.world_size"  # int >= 1
# Restart attempt of the rank's launcher (torchrun's TORCHELASTIC_RESTART_COUNT): 0 at first.
# A rank with a larger attempt or another world size starts a new world of its job.
RESOURCE_RESTART_ATTEMPT = "plait.restart.attempt"  # int >= 0
# The rank's replica group in a fault-tolerant job (`[fault_tolerance] replica_group`): each
# group is a world of its own (its own ranks 0..n-1). Absent or -1: not fault tolerant.
RESOURCE_REPLICA_GROUP = "plait.replica_group"  # int, -1 <= group < 2**31
NO_REPLICA_GROUP = -1
RESOURCE_DEVICE = "plait.device"  # str: "cpu", "cuda:0"
RESOURCE_DEVICE_NAME = "plait.device.name"  # str
RESOURCE_COMPUTE_DTYPE = "plait.compute_dtype"  # str: "bfloat16", "float32", ...
RESOURCE_PEAK_FLOPS = "plait.device.peak_flops"  # float FLOP/s, finite, >= 0 (0: unknown)
RESOURCE_PEAK_FLOPS_SOURCE = "plait.device.peak_flops.source"  # str
RESOURCE_MODEL_NAME = "plait.model.name"  # str
RESOURCE_NUM_PARAMS = "plait.model.num_params"  # int >= 0
RESOURCE_FLOPS_PER_TOKEN = "plait.model.flops_per_token"  # float FLOP, finite, >= 0
RESOURCE_TOKENS_PER_STEP = "plait.job.tokens_per_step"  # int >= 0
RESOURCE_MESH_COORD_PREFIX = "plait.mesh.coord."  # + axis: int, 0 <= coord < degree
RESOURCE_MESH_DEGREE_PREFIX = "plait.mesh.degree."  # + axis: int >= 1
# OpenTelemetry semantic conventions the daemon also reads.
RESOURCE_HOST_NAME = "host.name"  # str
RESOURCE_PROCESS_PID = "process.pid"  # int >= 0

# --------------------------------------------------------------------------------------------
# span attributes
# --------------------------------------------------------------------------------------------

SPAN_STEP = "plait.step"  # int, 0 <= step < 2**63 - 1 (shown + 1), on step/phase/comm spans
SPAN_STEP_TOKENS = "plait.step.tokens"  # int >= 0, whole job, this step
SPAN_STEP_MODEL_FLOPS = "plait.step.model_flops"  # float FLOP, whole job, this step
SPAN_STEP_DATA_WAIT = "plait.step.data_wait_seconds"  # float s >= 0
SPAN_STEP_LOSS = "plait.step.loss"  # float (NaN and inf allowed: a diverging run)
SPAN_STEP_LR = "plait.step.lr"  # float, informational
SPAN_STEP_GRAD_NORM = "plait.step.grad_norm"  # float, -1 when not computed; informational
SPAN_STEP_SKIPPED = "plait.step.skipped"  # bool, informational
SPAN_PHASE = "plait.phase"  # str: one of PHASES (others are kept, classified as nothing)
SPAN_MICROBATCH = "plait.microbatch"  # int, informational
SPAN_CHUNK = "plait.chunk"  # int, informational
SPAN_COMM_OP = "plait.comm.op"  # str: "all_reduce", "send", ...
SPAN_COMM_BYTES = "plait.comm.bytes"  # int By >= 0
SPAN_COMM_DTYPE = "plait.comm.dtype"  # str
SPAN_COMM_GROUP = "plait.comm.group"  # str: mesh group name
SPAN_COMM_GROUP_RANKS = "plait.comm.group_ranks"  # int[]: global ranks of the group
SPAN_COMM_SEQ = "plait.comm.seq"  # int >= 0: per-group sequence number
SPAN_COMM_PURPOSE = "plait.comm.purpose"  # str: "grad_bucket", "tp_activation", ...
SPAN_COMM_PEER = "plait.comm.peer"  # int >= 0: point-to-point peer
SPAN_COMM_ASYNC = "plait.comm.async"  # bool: issued with async_op (overlappable)
# What carried the op out: "torch" for the backend's own op (its bytes went on the wire as
# counted here), else the algorithm that took it over and issued sub-ops of its own.
SPAN_COMM_ALGORITHM = "plait.comm.algorithm"  # str
# Bytes this rank sent for the op inside its node and across nodes, by the byte model of the
# algorithm that carried it out (plait.core.link_bytes); absent when it has none or the host
# map is unknown. Summed per step over the spans carried by COMM_ALGORITHM_BACKEND only, so
# an algorithm's op and its sub-ops are not counted twice.
SPAN_COMM_BYTES_INTRA_NODE = "plait.comm.bytes.intra_node"  # int By >= 0
SPAN_COMM_BYTES_INTER_NODE = "plait.comm.bytes.inter_node"  # int By >= 0
COMM_ALGORITHM_BACKEND = "torch"
# Prefix of the free-form attributes a phase carries (`plait.` + the phase's own key).
SPAN_PHASE_ATTRIBUTE_PREFIX = "plait."
# The end of a rank's run (one span, sent as the rank shuts its telemetry down).
SPAN_JOB_OUTCOME = "plait.job.outcome"  # str: one of JOB_OUTCOMES
JOB_OUTCOME_FINISHED = "finished"
JOB_OUTCOME_FAILED = "failed"
JOB_OUTCOMES = (JOB_OUTCOME_FINISHED, JOB_OUTCOME_FAILED)
# Expert load of one MoE layer in one step (one span per layer per step), whole job.
SPAN_MOE_LAYER = "plait.moe.layer"  # str: the layer's module name
SPAN_MOE_TOKENS_PER_EXPERT = "plait.moe.tokens_per_expert"  # int[]: kept per expert, sum < 2**63
SPAN_MOE_DROPPED = "plait.moe.dropped"  # int >= 0: assignments dropped over capacity
# A change of a fault-tolerant job's quorum as one replica group saw it (one span per event,
# sent by the group's rank 0, timed over the quorum or the failed step; plait.step: its step).
SPAN_QUORUM_EVENT = "plait.ft.event"  # str: one of QUORUM_EVENTS
SPAN_QUORUM_ID = "plait.ft.quorum_id"  # int >= 0: the lighthouse's quorum id
SPAN_QUORUM_PARTICIPANTS = "plait.ft.participants"  # int >= 0: replica groups after it
SPAN_QUORUM_PREVIOUS = "plait.ft.previous"  # int >= 0: replica groups before it
SPAN_QUORUM_DETAIL = "plait.ft.detail"  # str: why a commit failed, where a heal came from
SPAN_REPLICA_ID = "plait.ft.replica_id"  # str: the group's id at the lighthouse
QUORUM_EVENT_JOIN = "join"  # the quorum grew
QUORUM_EVENT_LEAVE = "leave"  # the quorum shrank
QUORUM_EVENT_HEAL = "heal"  # the sending group took a live peer's state
QUORUM_EVENT_FAILED_COMMIT = "failed_commit"  # a step was tried and not committed
QUORUM_EVENTS = (QUORUM_EVENT_JOIN, QUORUM_EVENT_LEAVE, QUORUM_EVENT_HEAL,
                 QUORUM_EVENT_FAILED_COMMIT)  # fmt: skip
# A checkpoint save as the job's rank 0 saw it (`plait.checkpoint.save` spans): an instant when a
# save starts (outcome "started"), then one span over the write's own time when it ends.
SPAN_CHECKPOINT_STEP = "plait.checkpoint.step"  # int >= 0: steps done (the `step-N` directory)
SPAN_CHECKPOINT_ASYNC = "plait.checkpoint.async"  # bool: written beside training
SPAN_CHECKPOINT_OUTCOME = "plait.checkpoint.outcome"  # str: one of CHECKPOINT_OUTCOMES
SPAN_CHECKPOINT_BLOCKED = "plait.checkpoint.blocked_seconds"  # float s >= 0: the step waited
SPAN_CHECKPOINT_WRITE = "plait.checkpoint.write_seconds"  # float s >= 0: the write itself
SPAN_CHECKPOINT_BYTES = "plait.checkpoint.bytes"  # int By >= 0: files written (absent: unknown)
SPAN_CHECKPOINT_ERROR = "plait.checkpoint.error"  # str: a failed save's error, its first line
CHECKPOINT_STARTED = "started"  # the save began (an instant)
CHECKPOINT_SAVED = "saved"  # the checkpoint was published
CHECKPOINT_FAILED = "failed"  # it was not (the previous one is intact)
CHECKPOINT_OUTCOMES = (CHECKPOINT_STARTED, CHECKPOINT_SAVED, CHECKPOINT_FAILED)

# --------------------------------------------------------------------------------------------
# span names and classes
# --------------------------------------------------------------------------------------------

STEP_SPAN_NAME = "step"
JOB_END_SPAN_NAME = "plait.job.end"  # carries plait.job.outcome (and plait.step: the last)
EXPERT_LOAD_SPAN_NAME = "plait.moe.load"  # carries plait.step and the plait.moe.* attributes
QUORUM_EVENT_SPAN_NAME = "plait.ft.quorum"  # carries plait.step and the plait.ft.* attributes
CHECKPOINT_SAVE_SPAN_NAME = "plait.checkpoint.save"  # carries the plait.checkpoint.* attributes
# How the daemon classifies a span, first match wins (see `classify_span`).
SPAN_KIND_COMM = "comm"  # has plait.comm.op
SPAN_KIND_PHASE = "phase"  # has plait.phase
SPAN_KIND_STEP = "step"  # named "step" and has plait.step.model_flops
SPAN_KIND_JOB_END = "job_end"  # named "plait.job.end"
SPAN_KIND_EXPERT_LOAD = "expert_load"  # named "plait.moe.load"
SPAN_KIND_QUORUM = "quorum"  # named "plait.ft.quorum"
SPAN_KIND_CHECKPOINT = "checkpoint"  # named "plait.checkpoint.save"
SPAN_KIND_OTHER = "other"  # anything else: stored, shown in traces, not analysed
# Phase names the bottleneck analysis knows, by the class their time goes to.
PHASE_FORWARD = "forward"
PHASE_BACKWARD = "backward"
PHASE_BACKWARD_INPUT = "backward_input"
PHASE_BACKWARD_WEIGHT = "backward_weight"
PHASE_IDLE = "idle"
PHASE_SEND = "send"
PHASE_RECV = "recv"
PHASE_DATA = "data"
PHASE_OPTIMIZER = "optimizer"
COMPUTE_PHASES = frozenset({PHASE_FORWARD, PHASE_BACKWARD, PHASE_BACKWARD_INPUT,
                            PHASE_BACKWARD_WEIGHT})  # fmt: skip
BUBBLE_PHASES = frozenset({PHASE_IDLE, PHASE_RECV, PHASE_SEND})
DATA_PHASES = frozenset({PHASE_DATA})
OPTIMIZER_PHASES = frozenset({PHASE_OPTIMIZER})

# --------------------------------------------------------------------------------------------
# metrics a rank sends (name, unit)
# --------------------------------------------------------------------------------------------

METRIC_JOB_TOKENS = "plait.job.tokens"  # counter, {token}
METRIC_JOB_MODEL_FLOPS = "plait.job.model_flops"  # counter, {flop}
METRIC_STEP_DURATION = "plait.step.duration"  # histogram, s
METRIC_DATA_WAIT = "plait.data.wait"  # histogram, s
METRIC_TRAIN_LOSS = "plait.train.loss"  # gauge, no unit
METRIC_DEVICE_MEMORY_USED = "plait.device.memory.used"  # gauge, By, 0 <= value < 2**63
# Comm heartbeat gauges (hang detection, `plait.daemon.hangs`).
METRIC_COMM_HEARTBEAT = "plait.comm.heartbeat"  # gauge, s: Unix time of the export
METRIC_COMM_INFLIGHT = "plait.comm.inflight"  # gauge, s: an op in flight's start, Unix time
METRIC_COMM_ENTERED = "plait.comm.entered"  # gauge, {seq}: last seq issued on a group
# Attributes of the heartbeat points are the SPAN_COMM_* names: group, group_ranks, op, seq,
# purpose.

# UCUM units, as OpenTelemetry writes them.
UNIT_SECONDS = "s"
UNIT_BYTES = "By"
UNIT_RATIO = "1"
UNIT_FLOP = "{flop}"
UNIT_TOKEN = "{token}"
UNIT_TOKEN_PER_SECOND = "{token}/s"

METRIC_UNITS: dict[str, str] = {
    METRIC_JOB_TOKENS: UNIT_TOKEN,
    METRIC_JOB_MODEL_FLOPS: UNIT_FLOP,
    METRIC_STEP_DURATION: UNIT_SECONDS,
    METRIC_DATA_WAIT: UNIT_SECONDS,
    METRIC_DEVICE_MEMORY_USED: UNIT_BYTES,
    METRIC_COMM_HEARTBEAT: UNIT_SECONDS,
    METRIC_COMM_INFLIGHT: UNIT_SECONDS,
    METRIC_COMM_ENTERED: "{seq}",
}


def classify_span(name: str, attributes: dict[str, object] | None) -> str:
    """The span's kind: comm, phase, step, job_end, expert_load, quorum, checkpoint or other (the
    daemon's rule, in this order)."""
    attributes = attributes or {}
    if SPAN_COMM_OP in attributes:
        return SPAN_KIND_COMM
    if SPAN_PHASE in attributes:
        return SPAN_KIND_PHASE
    if name == STEP_SPAN_NAME and SPAN_STEP_MODEL_FLOPS in attributes:
        return SPAN_KIND_STEP
    if name == JOB_END_SPAN_NAME:
        return SPAN_KIND_JOB_END
    if name == EXPERT_LOAD_SPAN_NAME:
        return SPAN_KIND_EXPERT_LOAD
    if name == QUORUM_EVENT_SPAN_NAME:
        return SPAN_KIND_QUORUM
    if name == CHECKPOINT_SAVE_SPAN_NAME:
        return SPAN_KIND_CHECKPOINT
    return SPAN_KIND_OTHER
