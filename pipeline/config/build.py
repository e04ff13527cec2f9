"""A RunConfig from a mapping: pydantic checks every field at once (type, declared range, finiteness,
choices, unknown keys), and each of its errors becomes one line naming the field by its dotted path,
as ``--set`` spells it. A field refused keeps its default, so the rules across fields still run."""

from __future__ import annotations

import copy
import dataclasses
import types
import typing
from typing import Annotated, Any, Union

from annotated_types import Ge, Gt, Le, Lt
from pydantic import ValidationError

from pipeline.config.messages import choice_problem, did_you_mean, shown
from pipeline.config.schema import RunConfig, field_values, section_type

RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal", "finite_number"}
UNKNOWN_KEY_ERRORS = {"unexpected_keyword_argument", "extra_forbidden"}
SECTION_ERRORS = {"dataclass_exact_type", "dataclass_type"}
INT64 = range(-(2**63), 2**63)  # torch, numpy and Arrow hold an int in 64 bits


def build(data: dict[str, Any], problems: list[str]) -> RunConfig:
    """``RunConfig`` from ``data``; every refused field (or key) is a line in ``problems`` and keeps its default."""
    data = copy.deepcopy(data)
    for _ in range(3):  # the second pass, without the refused fields, passes
        try:
            cfg = RunConfig(**{_key(k): v for k, v in data.items()})
        except ValidationError as e:
            refused = _group(e.errors())
            problems.extend(p for path, errors in refused.items() for p in _problems(path, errors, data))
        else:
            big = _over_64_bits(cfg)
            problems.extend(f"{item}: {shown(value)} does not fit in 64 bits" for _, item, value in big)
            refused = {tuple(path.split(".")): [] for path, _, _ in big}
            if not refused:
                return _as_written(cfg, data)
        for path in refused:
            _drop(data, path)
    return RunConfig()


def _key(key: Any) -> str:
    return key if isinstance(key, str) else shown(key)


def _group(errors: list[dict]) -> dict[tuple[str, ...], list[dict]]:
    """Pydantic's errors by the field they are about (its dotted path as a tuple), in their order."""
    out: dict[tuple[str, ...], list[dict]] = {}
    for err in errors:
        path, inside = _locate(err["loc"])
        out.setdefault(path, []).append({**err, "inside": inside})
    return out


def _locate(loc: tuple) -> tuple[tuple[str, ...], tuple]:
    """(the field's path, the rest of ``loc``: list indices, mapping keys, union members inside its value)."""
    cls: type = RunConfig
    for i, part in enumerate(loc):
        sub = section_type(cls, part) if isinstance(part, str) else None
        if sub is None or i == len(loc) - 1:
            return tuple(str(p) for p in loc[: i + 1]), loc[i + 1:]
        cls = sub
    return tuple(str(p) for p in loc), ()


def _owner(path: tuple[str, ...]) -> type:
    cls: type = RunConfig
    for part in path[:-1]:
        cls = section_type(cls, part) or cls
    return cls


def _problems(path: tuple[str, ...], errors: list[dict], data: dict) -> list[str]:
    """The lines for one field's errors: unknown key, not a mapping, not a choice, out of range, or wrong type."""
    cls, key = _owner(path), path[-1]
    prefix = "".join(f"{p}." for p in path[:-1])
    name = prefix + (key if key.isprintable() and len(key) <= 80 else shown(key))
    kinds = {e["type"] for e in errors}
    if kinds & UNKNOWN_KEY_ERRORS:
        fields = [f.name for f in dataclasses.fields(cls)]
        return [f"{name}: unknown key" + (did_you_mean(key, fields, prefix) or f" (allowed: {', '.join(fields)})")]
    if kinds & SECTION_ERRORS:
        return [f"{name}: expected a mapping of {section_type(cls, key).__name__} fields, got {shown(errors[0]['input'])}"]
    bare = typing.get_type_hints(cls)[key]
    if "literal_error" in kinds:
        return choice_problem(name, errors[0]["input"], typing.get_args(bare))
    declared = typing.get_type_hints(cls, include_extras=True)[key]
    in_range = [_range_problem(name, e, declared) for e in errors if e["type"] in RANGE_ERRORS]
    return in_range or [f"{name}: expected {_type_name(bare)}, got {shown(_get(data, path))}"]


def _range_problem(name: str, err: dict, declared: Any) -> str:
    """``item: value must be [a finite number ]in [lo, hi] (note)``: the whole declared range, as it reads."""
    inside = err["inside"][1:] if _is_union(declared) else err["inside"]  # [0] names the union member
    item = name + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in inside)
    bounds, notes = _declared(declared, inside)
    finite = "a finite number " if err["type"] == "finite_number" else ""
    return f"{item}: {shown(err['input'])} must be {finite}{range_text(bounds)}".rstrip() + "".join(f" ({n})" for n in notes)


def _strip(tp: Any) -> Any:
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _is_union(tp: Any) -> bool:
    """A union pydantic tags its members in (``int | None`` it does not)."""
    tp = _strip(tp)
    members = [a for a in typing.get_args(tp) if a is not type(None)]
    return typing.get_origin(tp) in (Union, types.UnionType) and len(members) > 1


def _declared(tp: Any, inside: tuple) -> tuple[list, list[str]]:
    """(bounds, notes) declared for the item at ``inside`` of a field of type ``tp``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:
        bounds, notes = _declared(args[0], inside)
        return (bounds + [m for m in args[1:] if isinstance(m, (Ge, Gt, Le, Lt))],
                notes + [m for m in args[1:] if isinstance(m, str)])
    if origin in (Union, types.UnionType):  # the scalar member, or the list/mapping one for an item inside
        member = next((a for a in args if a is not type(None)
                       and (typing.get_origin(_strip(a)) in (list, dict)) == bool(inside)), None)
        return _declared(member, inside) if member is not None else ([], [])
    if origin in (list, dict) and inside:
        return _declared(args[-1], inside[1:])
    return [], []


def range_text(bounds: list[Any]) -> str:
    """``> 0``, ``>= 1``, ``in [0, 1)``: the declared range as the message shows it."""
    low = next((b for b in bounds if isinstance(b, (Ge, Gt))), None)
    high = next((b for b in bounds if isinstance(b, (Le, Lt))), None)
    lo = None if low is None else (low.ge if isinstance(low, Ge) else low.gt)
    hi = None if high is None else (high.le if isinstance(high, Le) else high.lt)
    if low is not None and high is not None:
        return f"in {'[' if isinstance(low, Ge) else '('}{lo}, {hi}{']' if isinstance(high, Le) else ')'}"
    if low is not None:
        return f"{'>=' if isinstance(low, Ge) else '>'} {lo}"
    return f"{'<=' if isinstance(high, Le) else '<'} {hi}" if high is not None else ""


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin is not None:
        return str(tp).replace("typing.", "")
    return getattr(tp, "__name__", str(tp))


def _items(name: str, value: Any) -> typing.Iterator[tuple[str, Any]]:
    """Every number inside a field's value, by its item name (``x[1]``, ``x.key``)."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _items(f"{name}.{k}", v)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _items(f"{name}[{i}]", v)
    else:
        yield name, value


def _over_64_bits(cfg: RunConfig) -> list[tuple[str, str, int]]:
    """(field, item, value) for each int, at any depth, that does not fit in 64 bits."""
    return [(name, item, v) for name, value in field_values(cfg).items() for item, v in _items(name, value)
            if isinstance(v, int) and not isinstance(v, bool) and v not in INT64]


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for part in path:
        data = next((v for k, v in data.items() if _key(k) == part), None) if isinstance(data, dict) else None
    return data


def _drop(data: dict, path: tuple[str, ...]) -> None:
    """Remove the field (or key) at ``path`` from ``data``, so it keeps its default."""
    node = _get(data, path[:-1]) if len(path) > 1 else data
    if isinstance(node, dict):
        for k in [k for k in node if _key(k) == path[-1]]:
            del node[k]


def _as_written(cfg: RunConfig, data: dict) -> RunConfig:
    """Numbers kept as written: pydantic makes a float field's ``1`` into ``1.0``, which would change the
    resolved config.yaml a run writes (and reads back when it resumes)."""
    for name, value in field_values(cfg).items():
        raw = _get(data, tuple(name.split(".")))
        kept = _int_as_given(value, raw)
        if kept is not value:
            *sections, last = name.split(".")
            setattr(_section(cfg, sections), last, kept)
    return cfg


def _int_as_given(value: Any, raw: Any) -> Any:
    if isinstance(value, float) and isinstance(raw, int) and not isinstance(raw, bool) and value == raw:
        return raw
    if isinstance(value, dict) and isinstance(raw, dict) and any(_int_as_given(v, raw.get(k)) is not v for k, v in value.items()):
        return {k: _int_as_given(v, raw.get(k)) for k, v in value.items()}
    return value


def _section(cfg: RunConfig, parts: list[str]) -> Any:
    node: Any = cfg
    for part in parts:
        node = getattr(node, part)
    return node
