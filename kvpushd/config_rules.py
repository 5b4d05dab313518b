"""The configuration schema read back: each key's type, bounds and doc in words, for the errors that
``kvpushd.config`` raises and for the generated reference (scripts/gen_config_docs.py)."""

from __future__ import annotations

import re
import typing
from typing import Any

import msgspec
from msgspec import inspect as mi

from .core.errors import InvalidArgument


def _bare(t: mi.Type) -> mi.Type:
    return t.type if isinstance(t, mi.Metadata) else t


def _title(t: mi.Type) -> str:
    return str((t.extra_json_schema or {}).get("title", "")) if isinstance(t, mi.Metadata) else ""


def type_name(t: mi.Type) -> str:
    """"number", "list of strings", "table": the kind of TOML value a key takes."""
    t = _bare(t)
    if isinstance(t, mi.BoolType):
        return "bool"
    if isinstance(t, mi.IntType):
        return "integer"
    if isinstance(t, mi.FloatType):
        return "number"
    if isinstance(t, mi.StrType | mi.LiteralType):
        return "string"
    if isinstance(t, mi.VarTupleType | mi.ListType):
        return f"list of {type_name(t.item_type)}s"
    if isinstance(t, mi.UnionType):
        return " or ".join(type_name(x) for x in t.types)
    return "table"


def _number(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def bounds(t: mi.Type) -> str:
    """The values of that kind allowed, in words ("" when any)."""
    title, t = _title(t), _bare(t)
    if title:
        return title
    if isinstance(t, mi.IntType | mi.FloatType):
        if t.gt == 0 and t.ge is t.lt is t.le is None:
            return "positive"
        if t.ge is not None and t.le is not None:
            return f"{_number(t.ge)}..{_number(t.le)}"
        return ", ".join(f"{op} {_number(v)}" for op, v in ((">", t.gt), (">=", t.ge), ("<", t.lt), ("<=", t.le))
                         if v is not None)
    if isinstance(t, mi.StrType) and t.pattern:
        return f"matching {t.pattern}"
    if isinstance(t, mi.LiteralType):
        return "one of " + ", ".join(map(str, t.values))
    if isinstance(t, mi.VarTupleType | mi.ListType):
        parts = ["at least one entry" if t.min_length == 1 else ""]
        if each := bounds(t.item_type):
            parts.append(f"each {each}")
        return ", ".join(p for p in parts if p)
    if isinstance(t, mi.DictType) and (keys := bounds(t.key_type)):
        return f"keys {keys}"
    return ""


def phrase(t: mi.Type) -> str:
    """What a value must be: "a number", "a table of backend parameters" (a string's title says what it
    must match, not what it is)."""
    if (title := _title(t)) and not isinstance(_bare(t), mi.StrType):
        return title
    if isinstance(t := _bare(t), mi.UnionType):
        return " or ".join(phrase(x) for x in t.types)
    name = type_name(t)
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def _predicate(t: mi.Type) -> str:
    b = bounds(t)
    if isinstance(_bare(t), mi.VarTupleType) and not _title(t) and b.startswith("at least"):
        return f"have {b}"
    return f"be {b}"


_AT = re.compile(r"(?P<msg>.*?)(?: - at `(?P<in_key>key` in `)?\$(?P<path>[^`]*)`)?", re.S)
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]|\[\.\.\.\]")


def config_error(e: msgspec.ValidationError, data: Any, root: type[msgspec.Struct]) -> InvalidArgument:
    """msgspec's error -> one naming the key by its dotted name and saying what it must be."""
    m = _AT.fullmatch(str(e))
    assert m is not None
    msg, path = m["msg"], m["path"] or ""
    names: list[str] = []
    t: Any = root
    v = data
    for step in _STEP.finditer(path):
        t = _unwrap(t)
        if step[1] is not None:  # a Struct's field
            t = typing.get_type_hints(t, include_extras=True)[step[1]]
            v = v.get(step[1]) if isinstance(v, dict) else None
            names.append(step[1])
        elif step[2] is not None:  # a list's item
            t, v = typing.get_args(t)[0], v[int(step[2])]
            names[-1] += f"[{step[2]}]"
        else:  # an entry of a table: msgspec does not say which, the first that does not decode
            t = typing.get_args(_table(t))[1]
            k = next(k for k, x in v.items() if not _decodes(x, t))
            v = v[k]
            names.append(k)
    where = ".".join(names)
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", msg)
    if unknown:
        known = sorted(typing.get_type_hints(_unwrap(t)))
        what = f"key {where}.{unknown[1]}" if names else f"section [{unknown[1]}]"
        return InvalidArgument(f"config: unknown {what}; known: {known}")
    if m["in_key"]:
        key_type = typing.get_args(_table(t))[0]
        k = next(k for k in v if not _decodes(k, key_type))
        return InvalidArgument(f"config: [{where}.{k}]: the keys of {where} must {_predicate(mi.type_info(key_type))}")
    info = mi.type_info(t)
    if ", got `" in msg or isinstance(_bare(info), mi.StructType | mi.DictType):
        return InvalidArgument(f"config: {where} must be {phrase(info)}, got {v!r}")
    doc = (info.extra_json_schema or {}).get("description", "") if isinstance(info, mi.Metadata) else ""
    return InvalidArgument(f"config: {where} must {_predicate(info)}, got {v!r}" + (f" ({doc})" if doc else ""))


def _unwrap(t: Any) -> Any:
    while typing.get_origin(t) is typing.Annotated:
        t = typing.get_args(t)[0]
    return t


def _table(t: Any) -> Any:
    """The dict type of ``t`` (the table member of a union)."""
    t = _unwrap(t)
    for x in typing.get_args(t) if typing.get_origin(t) is not dict else ():
        if typing.get_origin(_unwrap(x)) is dict:
            return _unwrap(x)
    return t


def _decodes(value: Any, t: Any) -> bool:
    try:
        msgspec.convert(value, t)
    except msgspec.ValidationError:
        return False
    return True
