"""Dataclasses to plain msgpack-able data and back, checked against their type hints.

services/protocol.py frames messages with this. Rebuilding is strict: a field of the
wrong type, an unknown field or a missing one is a ProtocolError, so a peer can never
make the receiver hold a value its dataclass does not declare.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from functools import lru_cache
from typing import Any


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


# Items msgpack builds itself: a list of only these converts in one C pass, not a
# Python call per element (a step's token ids, a request's stop token ids).
_PLAIN_SCALARS = frozenset({int, float, str, bool, bytes, type(None)})


def to_plain(value: Any) -> Any:
    """Dataclasses as maps, enums as their values, sets and tuples as lists."""
    if dataclasses.is_dataclass(value):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (list, tuple, set, frozenset)):
        if set(map(type, value)) <= _PLAIN_SCALARS:
            return value if type(value) is list else list(value)
        return [to_plain(v) for v in value]
    if isinstance(value, dict):  # msgpack maps take string keys: ints travel as text
        return {str(k) if type(k) is int else k: to_plain(v) for k, v in value.items()}
    return value


@lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _from_plain(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _from_plain(value, arg, where)
            except ProtocolError:
                pass
        raise ProtocolError(f"{where}: {value!r} matches none of {tp}")
    if origin in (list, set, frozenset, tuple):  # tuple[X, ...]: args[0] is X
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list")
        if args[0] in (int, str) and set(map(type, value)) <= {args[0]}:
            items = value  # checked in one C pass (a bool is not an int)
        else:
            items = [_from_plain(v, args[0], f"{where}[]") for v in value]
        return items if origin is list else origin(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map")
        return {_key(k, args[0], where): _from_plain(v, args[1], f"{where}.{k}")
                for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return dataclass_from_plain(value, tp, where)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value)
        except ValueError:
            raise ProtocolError(f"{where}: {value!r} is not a {tp.__name__}") from None
    return _scalar(value, tp, where)


def _key(key: Any, tp: Any, where: str) -> Any:
    """A map key: an ``int`` key arrives as its decimal text (see ``to_plain``)."""
    if tp is int and isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            raise ProtocolError(f"{where}: key {key[:20]!r} is not an integer") from None
    return _from_plain(key, tp, where)


def _scalar(value: Any, tp: type, where: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, bool) or not isinstance(value, tp):
        raise ProtocolError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
    return value


def dataclass_from_plain(value: Any, cls: type, where: str) -> Any:
    """An instance of ``cls`` from ``value`` (a map), checked field by field."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected a map for {cls.__name__}")
    hints = _hints(cls)
    unknown = set(value) - set(hints)
    if unknown:
        raise ProtocolError(f"{where}: unknown fields {sorted(unknown)} for {cls.__name__}")
    kwargs = {name: _from_plain(v, hints[name], f"{where}.{name}") for name, v in value.items()}
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:  # missing fields, or SamplingParams validation
        raise ProtocolError(f"{where}: {e}") from None
