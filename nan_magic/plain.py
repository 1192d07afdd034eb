"""A Report as plain data (dicts, tuples, strings, numbers) and back.

A scene stores its Report this way, so that ``torch.load(path,
weights_only=True)`` opens it with no allowlist: nothing in the file names a
class. Read back field by field from the records' type annotations, so a
field added to a record needs nothing here. Stdlib only.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from typing import Any, Literal, TypeVar, Union

__all__ = ["from_plain", "jsonable", "to_pairs", "to_plain"]

T = TypeVar("T")


def to_plain(value: Any) -> Any:
    """Records to dicts of their fields, enums to their values; floats stay floats (inf, NaN included)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: to_plain(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return tuple(to_plain(item) for item in value)
    return value


def to_pairs(value: Any) -> Any:
    """As :func:`to_plain`, with each record as a tuple of ``(field, value)`` pairs.

    Tuples alone, so the result hashes and fits a :class:`~nan_magic.records.Cause`'s
    facts; :func:`from_plain` reads it back the same way.
    """
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return tuple((field.name, to_pairs(getattr(value, field.name))) for field in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return tuple(to_pairs(item) for item in value)
    return to_plain(value)


def from_plain(record_type: type[T], data: Any) -> T:
    """The record of ``record_type`` that :func:`to_plain` turned into ``data``.

    A field the data lacks (written by an older version) takes its default.
    """
    return _decode(record_type, data)


def _decode(hint: Any, value: Any) -> Any:
    if value is None:
        return None
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        options = [option for option in typing.get_args(hint) if option is not type(None)]
        return _decode(options[0], value) if len(options) == 1 else value
    if origin is tuple:
        arguments = typing.get_args(hint)
        if len(arguments) == 2 and arguments[1] is Ellipsis:
            return tuple(_decode(arguments[0], item) for item in value)
        return tuple(_decode(argument, item) for argument, item in zip(arguments, value))
    if origin is Literal or hint is Any:
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        hints = typing.get_type_hints(hint)
        known = {field.name for field in dataclasses.fields(hint)}
        items = value.items() if isinstance(value, dict) else value  # to_plain's dict or to_pairs' pairs
        return hint(**{name: _decode(hints[name], item) for name, item in items if name in known})
    return value


def jsonable(value: Any) -> Any:
    """``dataclasses.asdict`` output made JSON-safe (Report.to_json): enums and inf/nan as strings."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(item) for item in value]
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
