"""A trace request decoded into what the store keeps, and that decoding as compact bytes.

Receiving a span has two halves. *Decoding* (`decode_resources`) reads every resource and span
through `plait.daemon.decoder`, deciding what is a rank, what is rejected and why, and building
the `SpanRecord`s; it needs no store and no lock, so it can run in another process
(`plait.daemon.ingest_pool`). *Storing* (`TraceReceiver` in `plait.daemon.otlp`) counts the
rejects and adds the records to the rank windows.

A worker process decodes each span into its `SpanFields` (plain tuples, dicts and numbers) and
hands the request back as `encode_resources` bytes, written with `marshal` (C code on both
sides, about 1 µs per span to read back); `decode_wire` turns them into the same
`DecodedResource`s the daemon would have built itself. The bytes only ever travel between the
daemon and the workers it started.
"""

from __future__ import annotations

import marshal
from dataclasses import dataclass, field
from typing import Any

from plait.daemon.decoder import (
    RankIdentity,
    Rejected,
    StaticsCache,
    decode_resource,
    span_record,
)
from plait.daemon.otlp_wire import WireResource

# Bumped whenever the tuples below change shape: a daemon never reads another version's bytes.
WIRE_VERSION = 3  # 2: span fields end with the quorum figures; 3: then the checkpoint figures


@dataclass(slots=True)
class SpanReject:
    """A span the decoder rejected, and where it sits in the request (left out upstream)."""

    error: Rejected
    scope_index: int
    span_index: int


@dataclass(slots=True)
class DecodedResource:
    """One `ResourceSpans` of a request, decoded.

    `identity` is None for a resource that is not a plait rank (its spans are only counted as
    ignored) and for a rejected one (`rejected` says why; all its spans are rejected with it).
    """

    index: int  # position in the request's resource_spans
    attributes: dict[str, Any]
    span_count: int
    identity: RankIdentity | None = None
    rejected: Rejected | None = None
    # The spans decoded: `SpanRecord`s, or their `SpanFields` when decoded for the wire.
    records: list[Any] = field(default_factory=list)
    span_rejects: list[SpanReject] = field(default_factory=list)


def decode_resources(
    resources: list[WireResource], statics: StaticsCache, *, for_wire: bool = False
) -> list[DecodedResource]:
    """Every resource and span of a request through the decoder (`Rejected` items kept apart);
    `for_wire`: spans as `SpanFields` for `encode_resources`, else as `SpanRecord`s."""
    decoded = []
    for index, resource in enumerate(resources):
        spans = resource.spans
        out = DecodedResource(index, resource.attributes, len(spans))
        decoded.append(out)
        try:
            out.identity = decode_resource(resource.attributes)
        except Rejected as error:
            out.rejected = error.detached()
            continue
        if out.identity is None:
            continue
        records = out.records
        decode = statics.decode_fields if for_wire else statics.decode
        for span in spans:
            try:
                records.append(
                    decode(
                        span.name,
                        span.start_ns,
                        span.end_ns,
                        span.attributes,
                        span.error,
                        span.shape,
                    )
                )
            except Rejected as error:
                out.span_rejects.append(
                    SpanReject(error.detached(), span.scope_index, span.span_index)
                )
    return decoded


# --------------------------------------------------------------------------------------------
# compact bytes between a worker and the daemon
# --------------------------------------------------------------------------------------------


def _rejected_tuple(error: Rejected) -> tuple[str, str, str]:
    return (error.attribute, error.reason, error.detail)


def encode_resources(decoded: list[DecodedResource]) -> bytes:
    """`decoded` (`decode_resources(..., for_wire=True)`) as bytes for `decode_wire`
    (identities are decoded again from the attributes on the other side: once per resource,
    against thousands of spans)."""
    return marshal.dumps(
        (
            WIRE_VERSION,
            [
                (
                    resource.index,
                    resource.attributes,
                    resource.span_count,
                    resource.identity is not None,
                    None if resource.rejected is None else _rejected_tuple(resource.rejected),
                    resource.records,
                    [
                        (*_rejected_tuple(reject.error), reject.scope_index, reject.span_index)
                        for reject in resource.span_rejects
                    ],
                )
                for resource in decoded
            ],
        )
    )


def decode_wire(data: bytes) -> list[DecodedResource]:
    """What `encode_resources` wrote; `ValueError` for bytes of another version."""
    version, resources = marshal.loads(data)
    if version != WIRE_VERSION:
        raise ValueError(f"ingest wire version {version}, this daemon reads {WIRE_VERSION}")
    decoded = []
    for index, attributes, span_count, is_rank, rejected, records, rejects in resources:
        resource = DecodedResource(index, attributes, span_count)
        if rejected is not None:
            resource.rejected = Rejected(*rejected)
        elif is_rank:
            # Decoded by the worker already: the same attributes decode the same way here.
            resource.identity = decode_resource(attributes)
            resource.records = [span_record(fields) for fields in records]
            resource.span_rejects = [
                SpanReject(Rejected(attribute, reason, detail), scope_index, span_index)
                for attribute, reason, detail, scope_index, span_index in rejects
            ]
        decoded.append(resource)
    return decoded
