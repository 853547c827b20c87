"""OTLP trace requests written straight to protobuf wire bytes.

NOTE: this deliberately does not build `opentelemetry.proto` message objects. Constructing a
`Span` with its `KeyValue`/`AnyValue` children costs ~40 µs of Python per span on the 2-core
machines plait trains on, and that CPU is taken from the ranks; writing the bytes costs a
fraction of it, mostly because the attributes that repeat (op names, groups, purposes, phase
names) are encoded once and reused. The messages written here are a small, stable part of
OTLP (`opentelemetry/proto/trace/v1/trace.proto`, field numbers below); the tests parse every
byte with the official classes and run it through the daemon's decoder.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any

# Field tags: (field number << 3) | wire type (0 varint, 1 fixed64, 2 length-delimited).
_REQUEST_RESOURCE_SPANS = 0x0A  # ExportTraceServiceRequest.resource_spans = 1
_RESOURCE_SPANS_RESOURCE = 0x0A  # ResourceSpans.resource = 1
_RESOURCE_SPANS_SCOPE_SPANS = 0x12  # ResourceSpans.scope_spans = 2
_RESOURCE_ATTRIBUTES = 0x0A  # Resource.attributes = 1
_SCOPE_SPANS_SCOPE = 0x0A  # ScopeSpans.scope = 1
_SCOPE_SPANS_SPANS = 0x12  # ScopeSpans.spans = 2
_SCOPE_NAME, _SCOPE_VERSION = 0x0A, 0x12  # InstrumentationScope.name = 1, version = 2
_SPAN_TRACE_ID, _SPAN_SPAN_ID, _SPAN_PARENT_ID = 0x0A, 0x12, 0x22  # fields 1, 2, 4
_SPAN_NAME, _SPAN_KIND = 0x2A, 0x30  # fields 5, 6
_SPAN_START, _SPAN_END = 0x39, 0x41  # fixed64 fields 7, 8
_SPAN_ATTRIBUTES, _SPAN_STATUS = 0x4A, 0x7A  # fields 9, 15
_STATUS_MESSAGE, _STATUS_CODE = 0x12, 0x18  # Status.message = 2, code = 3
_KV_KEY, _KV_VALUE = 0x0A, 0x12  # KeyValue.key = 1, value = 2
_ANY_STRING, _ANY_BOOL, _ANY_INT = 0x0A, 0x10, 0x18  # AnyValue fields 1, 2, 3
_ANY_DOUBLE, _ANY_ARRAY = 0x21, 0x2A  # AnyValue fields 4 (fixed64), 5
_ARRAY_VALUES = 0x0A  # ArrayValue.values = 1
SPAN_KIND_INTERNAL = 1
STATUS_CODE_ERROR = 2

_PRIMITIVES = (str, bool, int, float)
_TIMES = struct.Struct("<BBBQBQ")  # kind, then the start and end times (fixed64)
_MAX_CACHED = 65536  # distinct (key, value) pairs kept encoded


def varint(value: int) -> bytes:
    if value < 0:  # int64 negatives are ten-byte two's complement varints
        value += 1 << 64
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(tag: int, payload: bytes) -> bytes:
    return bytes((tag,)) + varint(len(payload)) + payload


def _text(tag: int, text: str) -> bytes:
    return _field(tag, text.encode())


def any_value(value: Any) -> bytes:
    """An `AnyValue` message body (bool before int: a bool must stay a bool on the wire)."""
    if isinstance(value, bool):
        return bytes((_ANY_BOOL, 1 if value else 0))
    if isinstance(value, int):
        return bytes((_ANY_INT,)) + varint(value)
    if isinstance(value, float):
        return bytes((_ANY_DOUBLE,)) + struct.pack("<d", value)
    if isinstance(value, str):
        return _text(_ANY_STRING, value)
    if isinstance(value, list | tuple) and all(isinstance(v, _PRIMITIVES) for v in value):
        items = b"".join(_field(_ARRAY_VALUES, any_value(v)) for v in value)
        return _field(_ANY_ARRAY, items)
    return _text(_ANY_STRING, str(value))


class AttributeEncoder:
    """Encodes `KeyValue` fields, reusing the bytes of pairs seen before."""

    def __init__(self) -> None:
        self._keys: dict[str, bytes] = {}
        self._pairs: dict[tuple[str, type, Any], bytes] = {}
        self._blocks: dict[Hashable, bytes] = {}

    def key_value(self, key: str, value: Any) -> bytes:
        """One `attributes` entry (tag, length and KeyValue) of a span or resource."""
        # Strings, bools and tuples repeat from span to span; numbers mostly do not. The type is
        # part of the cache key so that 1, 1.0 and True stay different values.
        cacheable = isinstance(value, str | bool | tuple)
        if cacheable:
            cached = self._pairs.get((key, type(value), value))
            if cached is not None:
                return cached
        prefix = self._keys.get(key)
        if prefix is None:
            prefix = self._keys[key] = _text(_KV_KEY, key)
        encoded = _field(_SPAN_ATTRIBUTES, prefix + _field(_KV_VALUE, any_value(value)))
        if cacheable and len(self._pairs) < _MAX_CACHED:
            self._pairs[(key, type(value), value)] = encoded
        return encoded

    def int_value(self, key: str, value: int) -> bytes:
        """`key_value` for a non-negative int, the common case of varying attributes."""
        prefix = self._keys.get(key)
        if prefix is None:
            prefix = self._keys[key] = _text(_KV_KEY, key)
        number = varint(value)
        entry = prefix + bytes((_KV_VALUE, 1 + len(number), _ANY_INT)) + number
        if len(entry) < 0x80:  # one-byte lengths: skip the general path
            return bytes((_SPAN_ATTRIBUTES, len(entry))) + entry
        return _field(_SPAN_ATTRIBUTES, entry)

    def attributes(self, attributes: Mapping[str, Any]) -> bytes:
        return b"".join(self.key_value(k, v) for k, v in attributes.items())

    def block(self, key: Hashable, build: Callable[[], Mapping[str, Any]]) -> bytes:
        """The encoded attributes `build()` returns, encoded once per `key`."""
        cached = self._blocks.get(key)
        if cached is None:
            cached = self.attributes(build())
            if len(self._blocks) < _MAX_CACHED:
                self._blocks[key] = cached
        return cached

    def span(
        self,
        name: str,
        *,
        trace_id: bytes,
        span_id: bytes,
        parent_span_id: bytes = b"",
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | bytes,
        error: str = "",
    ) -> bytes:
        """One `ScopeSpans.spans` entry: tag, length and the `Span` message (`attributes` as a
        mapping, or already encoded)."""
        if len(trace_id) == 16 and len(span_id) == 8 and len(parent_span_id) in (0, 8):
            # The ids' lengths are fixed: their tags and lengths are constants (the common case).
            head = b"\x0a\x10" + trace_id + b"\x12\x08" + span_id
            if parent_span_id:
                head += b"\x22\x08" + parent_span_id
        else:
            head = _field(_SPAN_TRACE_ID, trace_id) + _field(_SPAN_SPAN_ID, span_id)
            if parent_span_id:
                head += _field(_SPAN_PARENT_ID, parent_span_id)
        body = b"".join(
            (
                head,
                self.name(name),
                _TIMES.pack(
                    _SPAN_KIND, SPAN_KIND_INTERNAL, _SPAN_START, start_ns, _SPAN_END, end_ns
                ),
                attributes if isinstance(attributes, bytes) else self.attributes(attributes),
            )
        )
        if error:
            status = _text(_STATUS_MESSAGE, error) + bytes((_STATUS_CODE, STATUS_CODE_ERROR))
            body += _field(_SPAN_STATUS, status)
        return _field(_SCOPE_SPANS_SPANS, body)

    def name(self, name: str) -> bytes:
        cached = self._keys.get("\0" + name)  # span names share the key cache, apart
        if cached is None:
            cached = self._keys["\0" + name] = _text(_SPAN_NAME, name)
        return cached


def resource_attributes(attributes: Mapping[str, Any]) -> bytes:
    """The `Resource` message body for `attributes`."""
    return b"".join(
        _field(_RESOURCE_ATTRIBUTES, _text(_KV_KEY, key) + _field(_KV_VALUE, any_value(value)))
        for key, value in attributes.items()
    )


def scope(name: str, version: str) -> bytes:
    """The `InstrumentationScope` message body."""
    return _text(_SCOPE_NAME, name) + _text(_SCOPE_VERSION, version)


def export_request(resource: bytes, scope_body: bytes, spans: Iterable[bytes]) -> bytes:
    """An `ExportTraceServiceRequest` with one resource, one scope and the encoded `spans`."""
    scope_spans = _field(_SCOPE_SPANS_SCOPE, scope_body) + b"".join(spans)
    resource_spans = _field(_RESOURCE_SPANS_RESOURCE, resource) + _field(
        _RESOURCE_SPANS_SCOPE_SPANS, scope_spans
    )
    return _field(_REQUEST_RESOURCE_SPANS, resource_spans)
