"""A fast reader of OTLP trace requests: the spans the decoder needs, straight from the bytes.

NOTE: the daemon could let protobuf parse every request (`ExportTraceServiceRequest.FromString`)
and walk the message objects, and it does whenever this reader declines. But walking the
objects costs ~10 µs per span of Python (a wrapper object per `KeyValue` and `AnyValue`),
which caps one daemon at a few tens of thousands of spans per second. Here protobuf still
parses the request in C, but with view classes (`_view_classes`) in which every attribute is
left as its serialized `KeyValue` bytes; the attributes that repeat from span to span (op,
group, purpose, phase) are decoded once per distinct byte string, and integers (step, sequence
number) are read straight from their bytes.

What it yields is exactly what the message walk yields (`plait.daemon.otlp_requests.attributes`):
per resource its attributes, per span its name, times, attributes and error flag, with the
indices the receiver uses to leave rejected spans out of a forwarded copy, and each span's
*shape* when it came from a template: spans of one shape differ only in their numbers, so the
decoder decides their kind and strings once (`decoder.StaticsCache`). Every value still goes
through `plait.daemon.decoder` afterwards; nothing is validated here except the protobuf
encoding itself.

Anything this reader does not handle the way protobuf would — groups, events or links, scope
attributes, `kvlist` values, malformed or truncated bytes, a known field with another wire
type, invalid UTF-8 — raises `Decline`, and the caller parses the request with protobuf
instead (which rejects malformed bytes as before).
"""

from __future__ import annotations

import operator
import struct
from dataclasses import dataclass, field
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

_DOUBLE = struct.Struct("<d")
_FIXED64 = struct.Struct("<Q")
_MAX_CACHED = 65536
_MAX_NUMBERS = 4096
_MAX_SHAPES = 8  # layouts tried per entry count

# Wire types.
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


class Decline(ValueError):
    """These bytes are left to protobuf."""


@dataclass(slots=True)
class WireSpan:
    scope_index: int
    span_index: int
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: bool
    # Spans of equal shape have the same name and the same attributes except numbers (ints and
    # doubles): the decoder decides their kind and strings once (`decoder.StaticsCache`).
    # None: not known to repeat.
    shape: Any = None


@dataclass(slots=True)
class WireResource:
    attributes: dict[str, Any]
    spans: list[WireSpan] = field(default_factory=list)


def _varint(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    byte = buf[pos] if pos < end else -1
    if 0 <= byte < 0x80:
        return byte, pos + 1
    result = shift = 0
    while True:
        if pos >= end or shift > 63:
            raise Decline("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result & 0xFFFFFFFFFFFFFFFF, pos
        shift += 7


def _length(buf: bytes, pos: int, end: int) -> tuple[int, int]:
    """(end of the length-delimited payload, start of it) after its length varint at `pos`."""
    size, pos = _varint(buf, pos, end)
    stop = pos + size
    if stop > end:
        raise Decline("truncated field")
    return stop, pos


def _skip(buf: bytes, pos: int, end: int, wire_type: int) -> int:
    if wire_type == _VARINT:
        return _varint(buf, pos, end)[1]
    if wire_type == _I64:
        pos += 8
    elif wire_type == _LEN:
        pos = _length(buf, pos, end)[0]
    elif wire_type == _I32:
        pos += 4
    else:
        raise Decline(f"wire type {wire_type}")
    if pos > end:
        raise Decline("truncated field")
    return pos


def _text(buf: bytes, start: int, stop: int) -> str:
    try:
        return buf[start:stop].decode()
    except UnicodeDecodeError as exc:
        raise Decline("invalid UTF-8") from exc


def _tag(buf: bytes, pos: int, end: int) -> tuple[int, int, int]:
    key, pos = _varint(buf, pos, end)
    number = key >> 3
    if number == 0:
        raise Decline("field number 0")
    return number, key & 7, pos


def _want(wire_type: int, expected: int) -> None:
    if wire_type != expected:
        raise Decline("known field with another wire type")


def _view_classes() -> dict[str, Any]:
    """Message classes wire-compatible with OTLP's trace request, except that every attribute
    (`KeyValue`) stays its serialized bytes and events and links are only counted. protobuf
    parses them in C; only the attribute entries are left to Python, and those repeat."""
    field_type = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(
        name="plait/daemon/otlp_trace_view.proto", package=_VIEW_PACKAGE, syntax="proto3"
    )
    scalar = {
        "bytes": field_type.TYPE_BYTES,
        "string": field_type.TYPE_STRING,
        "int32": field_type.TYPE_INT32,
        "uint32": field_type.TYPE_UINT32,
        "fixed64": field_type.TYPE_FIXED64,
        "fixed32": field_type.TYPE_FIXED32,
    }
    # name -> [(number, field, type, repeated)]: the field numbers and wire types of
    # opentelemetry/proto/{collector/trace,trace,resource,common}/v1/*.proto.
    messages = {
        "Request": [(1, "resource_spans", "ResourceSpans", True)],
        "ResourceSpans": [
            (1, "resource", "Resource", False),
            (2, "scope_spans", "ScopeSpans", True),
            (3, "schema_url", "string", False),
        ],
        "Resource": [(1, "attributes", "bytes", True), (2, "dropped", "uint32", False)],
        "ScopeSpans": [
            (1, "scope", "Scope", False),
            (2, "spans", "Span", True),
            (3, "schema_url", "string", False),
        ],
        "Scope": [
            (1, "name", "string", False),
            (2, "version", "string", False),
            (3, "attributes", "bytes", True),
            (4, "dropped", "uint32", False),
        ],
        "Span": [
            (1, "trace_id", "bytes", False),
            (2, "span_id", "bytes", False),
            (3, "trace_state", "string", False),
            (4, "parent_span_id", "bytes", False),
            (5, "name", "string", False),
            (6, "kind", "int32", False),
            (7, "start", "fixed64", False),
            (8, "end", "fixed64", False),
            (9, "attributes", "bytes", True),
            (10, "dropped_attributes", "uint32", False),
            (11, "events", "bytes", True),
            (12, "dropped_events", "uint32", False),
            (13, "links", "bytes", True),
            (14, "dropped_links", "uint32", False),
            (15, "status", "Status", False),
            (16, "flags", "fixed32", False),
        ],
        "Status": [(2, "message", "string", False), (3, "code", "int32", False)],
    }
    for name, fields in messages.items():
        message = file.message_type.add(name=name)
        for number, field_name, kind, repeated in fields:
            entry = message.field.add(
                name=field_name,
                number=number,
                label=field_type.LABEL_REPEATED if repeated else field_type.LABEL_OPTIONAL,
            )
            if kind in scalar:
                entry.type = scalar[kind]
            else:
                entry.type = field_type.TYPE_MESSAGE
                entry.type_name = f".{_VIEW_PACKAGE}.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_VIEW_PACKAGE}.{name}"))
        for name in messages
    }


_VIEW_PACKAGE = "plait.daemon.otlpview"
_VIEWS = _view_classes()
_REQUEST_VIEW = _VIEWS["Request"]


class _Shape:
    """Where a span's repeating entries sit among its `count` entries (`positions`), and the
    templates seen with that layout, keyed by those entries' bytes."""

    __slots__ = ("fixed", "positions", "templates", "varying")

    def __init__(self, positions: tuple[int, ...], count: int) -> None:
        self.positions = positions
        self.varying = tuple(i for i in range(count) if i not in positions)
        self.fixed = operator.itemgetter(*positions)  # entries -> the template's key
        self.templates: dict[Any, _Template] = {}


@dataclass(frozen=True, slots=True, eq=False)  # hashed by identity: part of a span's shape
class _Template:
    attributes: dict[str, Any]  # the repeating entries, decoded
    lists: tuple[str, ...]  # keys whose values are lists (copied, never shared)


class TraceRequestReader:
    """Reads `ExportTraceServiceRequest` bytes; keeps a cache of decoded attribute entries."""

    def __init__(self) -> None:
        self._pairs: dict[bytes, tuple[str, Any]] = {}  # entry bytes -> (key, value)
        self._keys: dict[bytes, str] = {}  # key bytes -> key
        self._numbers: dict[bytes, tuple[str, int]] = {}  # recent integer entries
        self._shapes: dict[int, list[_Shape]] = {}  # entry count -> shapes seen
        self._templates = 0

    def read(self, buf: bytes) -> list[WireResource]:
        try:
            request = _REQUEST_VIEW.FromString(buf)
        except DecodeError as exc:  # protobuf says why, when the caller parses it for real
            raise Decline("malformed") from exc
        resources = []
        for resource_spans in request.resource_spans:
            attributes: dict[str, Any] = {}
            for entry in resource_spans.resource.attributes:
                key, value = self._entry(entry)
                attributes[key] = value
            resource = WireResource(attributes)
            out = resource.spans
            for scope_index, scope_spans in enumerate(resource_spans.scope_spans):
                if scope_spans.scope.attributes:
                    raise Decline("scope attributes")
                for span_index, span in enumerate(scope_spans.spans):
                    out.append(self._span(span, scope_index, span_index))
            resources.append(resource)
        return resources

    def _span(self, span: Any, scope_index: int, span_index: int) -> WireSpan:
        if span.events or span.links:
            raise Decline("span events or links")
        entries = tuple(span.attributes)
        name = span.name
        found = self._from_template(entries)
        if found is None:
            attributes = self._attributes(entries)
            self._learn(entries, attributes)
            shape = None
        else:
            attributes, shape = found
            if shape is not None:
                shape = (shape, name)
        return WireSpan(
            scope_index,
            span_index,
            name,
            span.start,
            span.end,
            attributes,
            span.status.code == 2,  # STATUS_CODE_ERROR
            shape,
        )

    def _attributes(self, entries: tuple[bytes, ...]) -> dict[str, Any]:
        """Every entry decoded in wire order (a key given twice: the last one wins)."""
        pairs = self._pairs
        attributes: dict[str, Any] = {}
        numbers = self._numbers
        for entry in entries:
            pair = pairs.get(entry) or numbers.get(entry)
            if pair is None:
                key, value = self._entry(entry)
                attributes[key] = value
                continue
            value = pair[1]
            attributes[pair[0]] = list(value) if type(value) is list else value
        return attributes

    def _from_template(
        self, entries: tuple[bytes, ...]
    ) -> tuple[dict[str, Any], tuple[Any, ...] | None] | None:
        """The attributes of a span whose repeating entries were seen together before: those
        are copied from the template, only the others (numbers) are read. With them, the span's
        shape when every other entry is a number: (template, their keys)."""
        for shape in self._shapes.get(len(entries), ()):
            template = shape.templates.get(shape.fixed(entries))
            if template is None:
                continue
            attributes = template.attributes.copy()
            for key in template.lists:
                attributes[key] = list(attributes[key])
            numbers, pairs = self._numbers, self._pairs
            keys: list[str] | None = []
            for position in shape.varying:
                entry = entries[position]
                pair = numbers.get(entry) or pairs.get(entry)
                if pair is None:
                    key, value = self._entry(entry)
                else:
                    key, value = pair
                    if type(value) is list:
                        value = list(value)
                attributes[key] = value
                if keys is not None:
                    if type(value) is int or type(value) is float:
                        keys.append(key)
                    else:  # a string or list the caches were too full to keep
                        keys = None
            # A key given twice: wire order decides which value wins, so read it in order.
            if len(attributes) != len(entries):
                return None
            return attributes, (template, *keys) if keys is not None else None
        return None

    def _learn(self, entries: tuple[bytes, ...], attributes: dict[str, Any]) -> None:
        """Remember which entries of this span repeat (cached strings, bools, lists) as a
        template, keyed by their bytes at their positions."""
        if len(attributes) != len(entries) or self._templates >= _MAX_CACHED:
            return
        pairs = self._pairs
        fixed = tuple(i for i, entry in enumerate(entries) if entry in pairs)
        if not fixed:
            return
        shapes = self._shapes.setdefault(len(entries), [])
        shape = next((s for s in shapes if s.positions == fixed), None)
        if shape is None:
            if len(shapes) >= _MAX_SHAPES:
                return
            shape = _Shape(fixed, len(entries))
            shapes.append(shape)
        values = dict(pairs[entries[i]] for i in fixed)
        lists = tuple(key for key, value in values.items() if type(value) is list)
        shape.templates[shape.fixed(entries)] = _Template(values, lists)
        self._templates += 1

    def _key(self, name_bytes: bytes) -> str:
        key = self._keys.get(name_bytes)
        if key is None:
            key = _text(name_bytes, 0, len(name_bytes))
            if len(self._keys) < _MAX_CACHED:
                self._keys[name_bytes] = key
        return key

    def _entry(self, entry: bytes) -> tuple[str, Any]:
        """A `KeyValue`'s bytes decoded; strings, bools and lists are cached, and the last few
        thousand numbers (a step number repeats in its step's spans, a sequence number never)."""
        # An int is `0x0A len key 0x12 len 0x18 varint`: read it without the general walk.
        size = entry[1] if len(entry) > 1 and entry[0] == 0x0A else 0x80
        value_at = 2 + size
        if (
            size < 0x80
            and len(entry) > value_at + 3
            and entry[value_at] == 0x12
            and entry[value_at + 1] == len(entry) - value_at - 2
            and entry[value_at + 2] == 0x18
        ):
            key = self._key(entry[2:value_at])
            raw, at = _varint(entry, value_at + 3, len(entry))
            if at == len(entry):
                number = raw - (1 << 64) if raw >= 1 << 63 else raw
                # A step number repeats in every span of its step, a sequence number never:
                # a small cache, emptied when full, keeps the first and forgets the second.
                if len(self._numbers) >= _MAX_NUMBERS:
                    self._numbers.clear()
                self._numbers[entry] = (key, number)
                return key, number
        elif (
            size < 0x80
            and len(entry) == value_at + 11
            and entry[value_at : value_at + 3] == b"\x12\x09\x21"
        ):
            # A double is `0x0A len key 0x12 0x09 0x21 <8 bytes>` (loss, learning rate, FLOPs).
            key = self._key(entry[2:value_at])
            number = _DOUBLE.unpack_from(entry, value_at + 3)[0]
            if len(self._numbers) >= _MAX_NUMBERS:
                self._numbers.clear()
            self._numbers[entry] = (key, number)
            return key, number
        key, value = self._key_value(entry, 0, len(entry))
        if type(value) in (str, bool, list) and len(self._pairs) < _MAX_CACHED:
            self._pairs[entry] = (key, value)
            if type(value) is list:
                value = list(value)  # the cached list is never handed out
        return key, value

    def _key_value(self, buf: bytes, pos: int, end: int) -> tuple[str, Any]:
        key, value = "", None
        seen_value = False
        while pos < end:
            number, wire_type, pos = _tag(buf, pos, end)
            if number in (1, 2):
                _want(wire_type, _LEN)
            if number == 1:
                stop, start = _length(buf, pos, end)
                key = _text(buf, start, stop)
                pos = stop
            elif number == 2:
                if seen_value:
                    raise Decline("value given twice")
                seen_value = True
                stop, start = _length(buf, pos, end)
                value = self._any_value(buf, start, stop)
                pos = stop
            else:
                pos = _skip(buf, pos, end, wire_type)
        if pos != end:
            raise Decline("field runs past its message")
        return key, value

    def _any_value(self, buf: bytes, pos: int, end: int) -> Any:
        """An `AnyValue` as `plait.daemon.otlp_requests.any_value` gives it (last set wins)."""
        value: Any = None
        seen_array = False
        while pos < end:
            number, wire_type, pos = _tag(buf, pos, end)
            if number == 1:  # string_value
                _want(wire_type, _LEN)
                stop, start = _length(buf, pos, end)
                value = _text(buf, start, stop)
                pos = stop
            elif number == 2:  # bool_value
                _want(wire_type, _VARINT)
                raw, pos = _varint(buf, pos, end)
                value = raw != 0
            elif number == 3:  # int_value (int64)
                _want(wire_type, _VARINT)
                raw, pos = _varint(buf, pos, end)
                value = raw - (1 << 64) if raw >= 1 << 63 else raw
            elif number == 4:  # double_value
                _want(wire_type, _I64)
                if pos + 8 > end:
                    raise Decline("truncated double")
                value = _DOUBLE.unpack_from(buf, pos)[0]
                pos += 8
            elif number == 5:  # array_value
                _want(wire_type, _LEN)
                if seen_array:  # protobuf would concatenate the two
                    raise Decline("array given twice")
                seen_array = True
                stop, start = _length(buf, pos, end)
                value = self._array(buf, start, stop)
                pos = stop
            elif number in (6, 7):  # kvlist_value, bytes_value: left to protobuf
                raise Decline("kvlist or bytes value")
            else:
                pos = _skip(buf, pos, end, wire_type)
        if pos != end:
            raise Decline("field runs past its message")
        return value

    def _array(self, buf: bytes, pos: int, end: int) -> list[Any]:
        values = []
        while pos < end:
            number, wire_type, pos = _tag(buf, pos, end)
            if number == 1:
                _want(wire_type, _LEN)
                stop, start = _length(buf, pos, end)
                values.append(self._any_value(buf, start, stop))
                pos = stop
            else:
                pos = _skip(buf, pos, end, wire_type)
        if pos != end:
            raise Decline("field runs past its message")
        return values
