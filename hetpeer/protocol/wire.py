"""Strict readers for untrusted wire values (JSON files, DHT records).

Every reader takes the value and the dotted path it was found at, and raises `SchemaError` naming
both when the value is not of the expected form. Nothing is coerced silently: a string is not a
number, a bool is not an int, and NaN or infinity is never a valid measurement.
"""

from __future__ import annotations

import math
from typing import Any, Mapping


class SchemaError(ValueError):
    """A wire value that does not match its schema; `path` says where, the message says why."""

    def __init__(self, path: str, message: str) -> None:
        # a path holds keys from the document: escaped, so that a key cannot break or forge a log line
        super().__init__(f"{path if path.isprintable() else repr(path)[1:-1]}: {message}")
        self.path = path


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def need_mapping(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise SchemaError(path, f"must be an object, got {_show(value)}")
    return value


def need_list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise SchemaError(path, f"must be a list, got {_show(value)}")
    return value


def need_str(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise SchemaError(path, f"must be a non-empty string, got {_show(value)}")
    return value


def need_int(value: Any, path: str, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(path, f"must be an integer, got {_show(value)}")
    if minimum is not None and value < minimum:
        raise SchemaError(path, f"must be at least {minimum}, got {value}")
    return value


def need_number(value: Any, path: str, *, positive: bool = False) -> float:
    """A finite real number; with `positive` it must be > 0, otherwise >= 0."""
    try:
        finite = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        finite = False
    if not finite:
        raise SchemaError(path, f"must be a finite number, got {_show(value)}")
    if positive and value <= 0:
        raise SchemaError(path, f"must be positive, got {_show(value)}")
    if value < 0:
        raise SchemaError(path, f"must not be negative, got {_show(value)}")
    return float(value)


def field(record: Mapping[str, Any], name: str, path: str) -> Any:
    if name not in record:
        raise SchemaError(f"{path}.{name}", "is missing")
    return record[name]


def no_extra_fields(record: Mapping[str, Any], allowed: set[str], path: str) -> None:
    extra = sorted(set(record) - allowed, key=str)  # keys need not be strings (msgpack), nor of one type
    if extra:
        raise SchemaError(f"{path}.{extra[0]}", f"is not a known field (known: {', '.join(sorted(allowed))})")
