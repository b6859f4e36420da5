"""The format's documents: strict JSON in, typed records, canonical JSON out.

A record is a frozen, keyword-only dataclass (`@record`) whose fields are typed with the annotations below and
bounded with `spec(...)`; building one (from code or from a JSON object, `Record.from_dict`) checks every field's
type and bounds, refuses keys the record does not declare, runs the record's own cross-field `check`, and raises
`SchemaError` (a ValueError) naming the field. Understood annotations: `bool`, `int` (never a bool), `float` (an
int is taken as a float), `str`, `Literal[...]`, a `Choice` enum (from its value), `list[X]`, `dict[str, X]`,
`X | None`, another record, and `Any` (any JSON value). `load_json` reads a JSON document strictly (UTF-8, size,
depth, finite numbers within int64), `parse_document` reads a versioned document into a record with one-line
IntegrityErrors naming the file and the field, and `canonical_json` writes the one form whose sha256 is stable
(sorted keys, indent 2, trailing newline). Imports nothing but the standard library.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import types
import typing
from enum import Enum
from typing import Any, Literal, TypeVar

from .integrity import IntegrityError

MANIFEST_MAX_BYTES = 1 << 20  # a manifest (or catalog entry) takes a few KiB; anything near this is not one
JSON_MAX_DEPTH = 32  # a manifest nests 4 deep, a catalog entry with a verification report 6

R = TypeVar("R", bound="Record")
record = dataclasses.dataclass(frozen=True, kw_only=True)  # how every record class is declared


class SchemaError(ValueError):
    """A value a record refuses: `loc` is the path of the field (names and list indexes), `msg` what is wrong."""

    def __init__(self, loc: tuple, msg: str):
        super().__init__(f"{'.'.join(map(str, loc)) or '(root)'}: {msg}" if loc else msg)
        self.loc, self.msg = loc, msg

    def within(self, *outer) -> SchemaError:
        return SchemaError((*outer, *self.loc), self.msg)

    @property
    def where(self) -> str:
        return ".".join(map(str, self.loc)) or "(root)"


def spec(default: Any = dataclasses.MISSING, *, factory: Any = dataclasses.MISSING, ge: float | None = None,
         le: float | None = None, min_length: int | None = None, pattern: str | None = None, omit_none: bool = False,
         check: typing.Callable[[Any], Any] | None = None) -> Any:
    """A record field with bounds: `ge`/`le` for numbers, `min_length` for lists, `pattern` (a full match) for
    strings, `check(value)` raising ValueError with the message; `omit_none`: the field is left out of the JSON form
    when None (a field that later schema versions add)."""
    meta = {"ge": ge, "le": le, "min_length": min_length, "pattern": pattern, "omit_none": omit_none, "check": check}
    return dataclasses.field(default=default, default_factory=factory, metadata=meta)


class Record:
    """Base of the format's records: validation on construction, `replace`, `to_dict`, `from_dict`."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            try:
                checked = _bounded(f, _coerce(_hints(type(self))[f.name], value))
            except SchemaError as exc:
                raise exc.within(f.name) from None
            if checked is not value:
                object.__setattr__(self, f.name, checked)
        try:
            self.check()
        except SchemaError:
            raise
        except ValueError as exc:
            raise SchemaError((), str(exc)) from None

    def check(self) -> None:
        """Cross-field rules of the record; raise ValueError with the message."""

    def replace(self: R, **changes) -> R:
        """A copy with `changes`, checked like any new record."""
        return dataclasses.replace(self, **changes)

    def to_dict(self, exclude: typing.Collection[str] = ()) -> dict[str, Any]:
        """The JSON form: enums as their values, records as objects, `omit_none` fields left out when None."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in exclude or (value is None and f.metadata.get("omit_none")):
                continue
            out[f.name] = _dump(value)
        return out

    @classmethod
    def from_dict(cls: type[R], data: Any) -> R:
        """The record a JSON object describes; SchemaError naming the first field at fault."""
        if isinstance(data, cls):
            return data
        if not isinstance(data, dict):
            raise SchemaError((), f"Input should be a valid dictionary or instance of {cls.__name__}")
        names = {f.name: f for f in dataclasses.fields(cls)}
        for f in names.values():
            if f.name not in data and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise SchemaError((f.name,), "Field required")
        for key in data:
            if key not in names:
                raise SchemaError((key,), "Extra inputs are not permitted")
        return cls(**data)

    @classmethod
    def required(cls) -> list[str]:
        """The names of the fields a JSON object must hold."""
        return [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """Each field's annotation, resolved."""
        return dict(_hints(cls))


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _expected(options) -> str:
    words = [repr(o.value if isinstance(o, Enum) else o) for o in options]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


def _coerce(tp: Any, value: Any) -> Any:
    """`value` as the annotation `tp` says, or SchemaError (loc relative to `value`)."""
    if tp is Any:
        return value
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(inner[0], value) if len(inner) == 1 else value
    if origin is Literal:
        options = typing.get_args(tp)
        if any(value == o and type(value) is type(o) for o in options):
            return value
        raise SchemaError((), f"Input should be {_expected(options)}")
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise SchemaError((), "Input should be a valid list")
        (item,) = typing.get_args(tp)
        out = []
        for i, v in enumerate(value):
            try:
                out.append(_coerce(item, v))
            except SchemaError as exc:
                raise exc.within(i) from None
        return out
    if origin is dict:
        if not isinstance(value, dict):
            raise SchemaError((), "Input should be a valid dictionary")
        key_type, item = typing.get_args(tp)
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise SchemaError((k,), "Keys should be strings")
            try:
                out[k] = _coerce(item, v)
            except SchemaError as exc:
                raise exc.within(k) from None
        return out
    if isinstance(tp, type) and issubclass(tp, Record):
        try:
            return tp.from_dict(value)
        except SchemaError:
            raise
        except TypeError as exc:  # cannot happen through from_dict; kept one line
            raise SchemaError((), str(exc)) from None
    if isinstance(tp, type) and issubclass(tp, Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, str) and value in tp._value2member_map_:
            return tp(value)
        raise SchemaError((), f"Input should be {_expected(list(tp))}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise SchemaError((), "Input should be a valid boolean")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise SchemaError((), "Input should be a valid integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value if type(value) is float else float(value)
        raise SchemaError((), "Input should be a valid number")
    if tp is str:
        if isinstance(value, str):
            return value
        raise SchemaError((), "Input should be a valid string")
    raise TypeError(f"records do not understand the annotation {tp!r}")


def _bounded(f: dataclasses.Field, value: Any) -> Any:
    meta = f.metadata
    if value is None:
        return value
    if meta.get("ge") is not None and not value >= meta["ge"]:
        raise SchemaError((), f"Input should be greater than or equal to {meta['ge']}")
    if meta.get("le") is not None and not value <= meta["le"]:
        raise SchemaError((), f"Input should be less than or equal to {meta['le']}")
    if meta.get("min_length") is not None and len(value) < meta["min_length"]:
        raise SchemaError((), f"List should have at least {meta['min_length']} item after validation, not "
                              f"{len(value)}")
    if meta.get("pattern") is not None and not re.fullmatch(meta["pattern"], value):
        raise SchemaError((), f"String should match pattern '{meta['pattern']}'")
    if meta.get("check") is not None:
        try:
            value = meta["check"](value)
        except SchemaError:
            raise
        except ValueError as exc:
            raise SchemaError((), str(exc)) from None
    return value


def _dump(value: Any) -> Any:
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_dump(v) for v in value]
    if isinstance(value, dict):
        return {k: _dump(v) for k, v in value.items()}
    return value


# -- JSON documents ----------------------------------------------------------------------------------------------------
class _BadNumber(ValueError):
    pass


def _finite_float(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise _BadNumber(f"the number {text[:40]} is out of range")
    return value


def _int64(text: str) -> int:
    if len(text.lstrip("-")) > 19 or not -(2**63) <= int(text) < 2**63:
        raise _BadNumber(f"the integer {text[:40]}{'…' if len(text) > 40 else ''} is out of range")
    return int(text)


def _no_constant(name: str):
    raise _BadNumber(f"{name} is not a JSON number")


def load_json(data: str | bytes, source: str) -> Any:
    """A JSON document as strict JSON: UTF-8, at most MANIFEST_MAX_BYTES and JSON_MAX_DEPTH deep, numbers finite and
    within int64 (no NaN/Infinity); IntegrityError naming `source` otherwise."""
    if len(data) > MANIFEST_MAX_BYTES:
        raise IntegrityError(f"{source} has {len(data):,} bytes, too many for an oscar-zoo document")
    if isinstance(data, bytes):
        try:
            data = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise IntegrityError(f"{source} is not UTF-8 text (byte {exc.start}); it is not an oscar-zoo document") \
                from None
    too_deep = f"{source} nests JSON too deep: deeper than {JSON_MAX_DEPTH} levels"
    try:
        doc = json.loads(data, parse_float=_finite_float, parse_int=_int64, parse_constant=_no_constant)
    except RecursionError:
        raise IntegrityError(too_deep) from None
    except json.JSONDecodeError as exc:
        raise IntegrityError(f"{source} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except _BadNumber as exc:
        raise IntegrityError(f"{source} is not valid oscar-zoo JSON: {exc}") from None
    stack = [(doc, 1)]
    while stack:  # iterative: the depth limit also keeps every later recursive walk (records, json.dumps) safe
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > JSON_MAX_DEPTH:
                raise IntegrityError(too_deep)
            stack.extend((child, depth + 1) for child in (node.values() if isinstance(node, dict) else node))
            stack.extend((key, depth) for key in (node if isinstance(node, dict) else ()))
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate (\ud800): no file or terminal could take it back
                raise IntegrityError(f"{source} holds a string that is not valid Unicode "
                                     f"({one_line(repr(node), 60)})") from None
    return doc


def check_version(doc: dict, source: str, field: str, versions: tuple[int, ...]) -> None:
    """`doc[field]` is one of `versions` (what this oscar-zoo reads); IntegrityError naming `source` otherwise."""
    found = doc.get(field)
    if isinstance(found, bool) or found not in versions:
        raise IntegrityError(
            f"{source} has {field} {one_line(repr(found), 40)}; this oscar-zoo reads version "
            f"{' and '.join(str(v) for v in versions)}",
            "upgrade oscar-zoo, or re-create the file with this version",
        )


def parse_document(cls: type[R], data: str | bytes | dict, source: str, version_field: str | None = None,
                   versions: tuple[int, ...] = ()) -> R:
    """A JSON document (text, bytes that must be UTF-8, or an already loaded object) as the record `cls`, its
    `version_field` one of `versions` (when given). Every failure is an IntegrityError naming the file and the field:
    `SOURCE is invalid at 'quant.flush': Input should be less than or equal to 1048576`."""
    doc = data if isinstance(data, dict) else load_json(data, source)
    if not isinstance(doc, dict):
        raise IntegrityError(f"{source} must hold a JSON object, found {type(doc).__name__}")
    if version_field is not None:
        check_version(doc, source, version_field, versions)
    try:
        return cls.from_dict(doc)
    except SchemaError as exc:
        raise IntegrityError(f"{source} is invalid at '{one_line(exc.where, 80)}': {one_line(exc.msg, 300)}") \
            from None


def canonical_json(data: Any) -> str:
    """The one JSON form of a document: sorted keys, indent 2, non-ASCII kept, a trailing newline."""
    return json.dumps(data, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def one_line(text: str, limit: int) -> str:
    """User-controlled text for a one-line message: control characters escaped, at most `limit` characters."""
    flat = "".join(c if c.isprintable() else repr(c)[1:-1] for c in str(text))
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
