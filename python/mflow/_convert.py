"""JSON objects into the module's dataclasses, by their type hints.

A key the dataclass does not name is left out (a newer mflow may add keys), a field spelled
differently in JSON names its key in ``metadata={"json": ...}`` (``class`` is a Python keyword).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")


def json_key(f: dataclasses.Field[Any]) -> str:
    """The JSON key of a dataclass field."""
    return f.metadata.get("json", f.name)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_json(cls: type[T], data: dict[str, Any]) -> T:
    """An instance of dataclass ``cls`` from a JSON object; ``TypeError`` when a key that has no
    default is missing."""
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if not f.init:
            continue
        key = json_key(f)
        if key in data:
            kwargs[f.name] = convert(hints[f.name], data[key])
    return cls(**kwargs)


def convert(tp: Any, value: Any) -> Any:
    """``value`` (decoded JSON) as type ``tp``; a value of another shape than the type's is
    kept as it is."""
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return convert(args[0], value) if len(args) == 1 else value
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [convert(item, v) for v in value]
    if origin is dict and isinstance(value, dict):
        _, item = typing.get_args(tp)
        return {k: convert(item, v) for k, v in value.items()}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type) and isinstance(value, dict):
        return from_json(tp, value)
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value
