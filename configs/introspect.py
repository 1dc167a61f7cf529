"""Reads the schema's dataclasses as data: field types, dotted key paths, readable type names.

Shared by the loader (type-directed conversion, ``--set`` path checks) and the reference.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, TypeGuard, Union


@dataclass(frozen=True)
class Leaf:
    """One configurable value: ``tiers.disk.path`` has section ``tiers.disk``, name ``path``."""

    path: str
    section: str
    name: str
    type: Any
    default: Any
    doc: str


def is_section(tp: Any) -> TypeGuard[type]:
    """Whether ``tp`` is a nested config section (a dataclass type)."""
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """Resolved type of each init field of the section ``cls``, in declaration order."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.init}


def union_arms(tp: Any) -> tuple[Any, ...]:
    """The alternatives of ``A | B`` (either spelling of a union), else ``()``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return ()


def describe(tp: Any) -> str:
    """A short readable name of a field type: ``int or 'auto'``, ``list[str]``, ``mapping``."""
    if is_section(tp):
        return "section"
    arms = union_arms(tp)
    if arms:
        return " or ".join(describe(arm) for arm in arms)
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(v) for v in typing.get_args(tp))
    if origin is list:
        return f"list[{describe(typing.get_args(tp)[0])}]"
    if origin is dict:
        return "mapping"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def default_of(f: dataclasses.Field[Any]) -> Any:
    """The default value of a field (calling its factory)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def walk_leaves(cls: type, prefix: str = "") -> Iterator[Leaf]:
    """Every leaf field under section ``cls``, depth first in declaration order.

    Defaults of fields are read from the field declarations, never by building ``cls``,
    so a section whose defaults alone do not validate can still be listed.
    """
    types_ = field_types(cls)
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}.{f.name}" if prefix else f.name
        tp = types_[f.name]
        if is_section(tp):
            yield from walk_leaves(tp, path)
        else:
            yield Leaf(path, prefix, f.name, tp, default_of(f), f.metadata.get("doc", ""))


def walk_sections(cls: type, prefix: str = "") -> Iterator[tuple[str, type, str]]:
    """Every nested section under ``cls`` as (dotted path, type, doc), depth first."""
    for f in dataclasses.fields(cls):
        tp = field_types(cls).get(f.name)
        if is_section(tp):
            path = f"{prefix}.{f.name}" if prefix else f.name
            yield path, tp, f.metadata.get("doc", "")
            yield from walk_sections(tp, path)


def did_you_mean(name: str, valid: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest valid name, or ``""``."""
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""

