"""The attributes of step, phase, comm and end-of-run spans
(`plait.daemon.telemetry_schema` names), and ids.

The exporter thread calls these and writes the spans with `plait.plugins.telemetry.otlp_wire`;
the training thread never does.
"""

from __future__ import annotations

import os
from typing import Any

from plait.core.step import PhaseSpan, StepReport
from plait.daemon import telemetry_schema as names
from plait.plugins.telemetry.comm_records import CommRecord


def new_trace_id() -> bytes:
    return os.urandom(16)


def new_span_id() -> bytes:
    return os.urandom(8)


def comm_static_key(record: CommRecord) -> tuple[Any, ...]:
    """What `comm_static_attributes` depends on: equal keys, equal attributes."""
    return (record.op, record.nbytes, record.dtype, record.group_name, record.group_ranks,
            record.purpose, record.async_op, record.peer, record.algorithm,
            record.links)  # fmt: skip


def comm_static_attributes(record: CommRecord) -> dict[str, Any]:
    """The attributes that repeat from op to op (all but the sequence number and step)."""
    attributes = comm_attributes(record)
    attributes.pop(names.SPAN_COMM_SEQ)
    attributes.pop(names.SPAN_STEP, None)
    return attributes


def comm_attributes(record: CommRecord) -> dict[str, Any]:
    attributes: dict[str, Any] = {
        names.SPAN_COMM_OP: record.op,
        names.SPAN_COMM_BYTES: record.nbytes,
        names.SPAN_COMM_DTYPE: str(record.dtype).removeprefix("torch.") if record.dtype else "",
        names.SPAN_COMM_GROUP: record.group_name,
        names.SPAN_COMM_GROUP_RANKS: tuple(record.group_ranks),  # hashable: encoded once
        names.SPAN_COMM_SEQ: record.seq,
        names.SPAN_COMM_PURPOSE: record.purpose,
        names.SPAN_COMM_ASYNC: record.async_op,
    }
    if record.peer is not None:
        attributes[names.SPAN_COMM_PEER] = record.peer
    if record.algorithm:
        attributes[names.SPAN_COMM_ALGORITHM] = record.algorithm
    if record.links is not None:
        attributes[names.SPAN_COMM_BYTES_INTRA_NODE] = record.links.intra_node
        attributes[names.SPAN_COMM_BYTES_INTER_NODE] = record.links.inter_node
    if record.step is not None:
        attributes[names.SPAN_STEP] = record.step
    return attributes


def step_attributes(report: StepReport) -> dict[str, Any]:
    return {
        names.SPAN_STEP: report.step,
        names.SPAN_STEP_TOKENS: report.tokens,
        names.SPAN_STEP_MODEL_FLOPS: float(report.model_flops),
        names.SPAN_STEP_DATA_WAIT: report.data_wait_seconds,
        names.SPAN_STEP_LOSS: report.loss,
        names.SPAN_STEP_LR: report.lr,
        names.SPAN_STEP_GRAD_NORM: report.grad_norm if report.grad_norm is not None else -1.0,
        names.SPAN_STEP_SKIPPED: report.skipped,
    }


def phase_attributes(
    step_number: int, phase: PhaseSpan, skip: str = "", *, step: bool = True
) -> dict[str, Any]:
    """A phase span's attributes (`step=False`: all but the step number, which varies)."""
    attributes: dict[str, Any] = {names.SPAN_STEP: step_number} if step else {}
    attributes[names.SPAN_PHASE] = phase.name
    if phase.microbatch is not None:
        attributes[names.SPAN_MICROBATCH] = phase.microbatch
    if phase.chunk is not None:
        attributes[names.SPAN_CHUNK] = phase.chunk
    for key, value in phase.attributes.items():
        if key != skip:
            attributes[names.SPAN_PHASE_ATTRIBUTE_PREFIX + key] = value
    return attributes


def job_end_attributes(outcome: str, last_step: int) -> dict[str, Any]:
    """The outcome, and the last step when one ran (`last_step` < 0: none did)."""
    attributes: dict[str, Any] = {names.SPAN_JOB_OUTCOME: outcome}
    if last_step >= 0:
        attributes[names.SPAN_STEP] = last_step
    return attributes
