"""`--json` output of the daemon commands: plain JSON a script reads without protobuf.

Messages become objects with every field present (defaults included, field names as in the
`.proto`; an unset `optional` scalar, which means "not applicable", is left out), integers stay
JSON numbers (protobuf's own JSON mapping writes 64-bit integers as strings), and a host that
could not be reached is an entry with its `error`, never a gap.
Figures are in base units (seconds, bytes, FLOP/s, fractions), as in the messages.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

SCHEMA_VERSION = 1


def message_dict(message: Message) -> dict[str, Any]:
    """Every field of `message`, recursively, as JSON-ready Python values."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            value_field = field.message_type.fields_by_name["value"]
            out[field.name] = {str(k): _scalar(v, value_field) for k, v in sorted(value.items())}
        elif _is_repeated(field):
            out[field.name] = [_scalar(v, field) for v in value]
        elif field.message_type is not None and not message.HasField(field.name):
            out[field.name] = None
        elif field.has_presence and not message.HasField(field.name):
            # An unset optional scalar says "not applicable" (a replica group outside fault
            # tolerance): left out, not written as its zero.
            continue
        else:
            out[field.name] = _scalar(value, field)
    return out


def _is_repeated(field: FieldDescriptor) -> bool:
    # `is_repeated` on newer protobuf; `label` on the older ones still supported.
    repeated = getattr(field, "is_repeated", None)
    return bool(repeated) if repeated is not None else field.label == FieldDescriptor.LABEL_REPEATED


def _scalar(value: Any, field: FieldDescriptor) -> Any:
    if isinstance(value, Message):
        return message_dict(value)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values_by_number[value].name
    if isinstance(value, float):
        return json_float(value)
    if isinstance(value, bytes):
        return value.hex()
    return value


def json_float(value: float) -> float | str:
    """NaN and infinities as strings: JSON has no literal for them (a diverging loss is NaN)."""
    return value if math.isfinite(value) else str(value)


def dataclass_dict(item: Any) -> dict[str, Any]:
    return {
        k: json_float(v) if isinstance(v, float) else v for k, v in dataclasses.asdict(item).items()
    }


def dumps(command: str, document: dict[str, Any]) -> str:
    """The printed document: which command made it, its schema version, then its content."""
    return json.dumps(
        {"command": command, "schema_version": SCHEMA_VERSION, **document},
        indent=2,
        allow_nan=False,
    )
