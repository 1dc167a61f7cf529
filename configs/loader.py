"""Loads the phalanx config once: YAML file, then ``PHALANX_SET``, then ``--set``, converted
strictly into ``PhalanxConfig``. Every error is a ConfigError naming the dotted key, the file
(or ``--set`` / ``PHALANX_SET``) and the YAML line.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import typing
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from yaml.constructor import SafeConstructor
from yaml.error import Mark

from phalanx.configs.errors import ConfigError
from phalanx.configs.introspect import describe, did_you_mean, field_types, is_section, union_arms
from phalanx.configs.overrides import apply_override, collect_overrides
from phalanx.configs.schema import PhalanxConfig

ROOT_KEY = "(root)"
YAML_KEY = "(yaml)"
FILE_KEY = "(file)"
_MAP_TAG = "tag:yaml.org,2002:map"
_NULL_TAG = "tag:yaml.org,2002:null"
# PyYAML (YAML 1.1) reads 1e3 as a string; a plain scalar in this form is a float here.
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")
_JSON_TYPES = (type(None), bool, int, float, str)
# Bounds on what a config file may expand to: deeper nesting overflows the recursive YAML
# composer and constructor, and aliases to aliases ("billion laughs") make a small file
# expand exponentially (then be walked, dumped and sent to every worker).
MAX_DEPTH = 64
MAX_NODES = 100_000
# Keys an earlier phalanx wrote into every run's saved config (<run>/config.yaml) and that
# no longer exist: ``load_config(..., drop=RETIRED_KEYS)`` reads such a saved config; a
# config a user writes with one of them gets the unknown-key error.
RETIRED_KEYS = frozenset({"recovery.can_shrink"})


def load_config(path: str | os.PathLike[str] | None, overrides: Sequence[str] = (),
                env: Mapping[str, str] | None = None,
                drop: Collection[str] = ()) -> PhalanxConfig:
    """Read ``path`` (None: no file), apply ``PHALANX_SET`` from ``env`` (default
    ``os.environ``) and then ``overrides`` (``--set`` texts), and build the config. Keys
    of the file named in ``drop`` (dotted paths, e.g. ``RETIRED_KEYS``) are ignored.

    An empty file means all defaults. Relative file paths inside the config are kept as
    written. Raises ConfigError for an unreadable file, invalid YAML, a duplicate or unknown
    key, a mistyped value, a malformed override or a failed cross-field check.
    """
    env = os.environ if env is None else env
    source = str(path) if path is not None else ""
    root = _compose_file(Path(path), source) if path is not None else None
    if root is None:
        mark = Mark(source, 0, -1, 0, None, 0)
        root = yaml.MappingNode(_MAP_TAG, [], mark, mark)
    _check_size(root, source)
    _reject_duplicates(root, "", source, set())
    for key in drop:
        _drop_key(root, key.split("."))
    for override in collect_overrides(PhalanxConfig, overrides, env):
        if isinstance(root, yaml.MappingNode):  # else _build reports the top level
            apply_override(root, override)
    return _build(PhalanxConfig, root, "", _Origins(source))


def load_config_text(text: str, source: str = "<text>") -> PhalanxConfig:
    """Build a config from YAML text (e.g. a ``dump_config`` passed to another process)."""
    root = _compose_text(text, source)
    if root is None:
        mark = Mark(source, 0, -1, 0, None, 0)
        root = yaml.MappingNode(_MAP_TAG, [], mark, mark)
    _check_size(root, source)
    _reject_duplicates(root, "", source, set())
    return _build(PhalanxConfig, root, "", _Origins(source))


def dump_config(cfg: PhalanxConfig) -> str:
    """The full effective config as YAML (defaults included), loadable by ``load_config``."""
    header = "# phalanx effective config: every key, defaults included\n"
    return header + yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False,
                                   default_flow_style=False, allow_unicode=True)


@dataclass(frozen=True)
class _Origin:
    source: str
    line: int | None


class _Origins:
    """Where each key path came from, so errors raised while building can be located."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.by_path: dict[str, _Origin] = {}

    def note(self, path: str, key: yaml.Node) -> _Origin:
        mark = key.start_mark
        origin = _Origin(mark.name, mark.line + 1 if mark.line >= 0 else None)
        self.by_path[path] = origin
        return origin

    def of(self, path: str) -> _Origin:
        """The origin of ``path``, else of its nearest enclosing section, else the file."""
        while path:
            if path in self.by_path:
                return self.by_path[path]
            path = path.rpartition(".")[0]
        return _Origin(self.source, None)

    def locate(self, exc: ConfigError) -> ConfigError:
        origin = self.of(exc.key)
        return exc.located(origin.source, origin.line)


def _drop_key(node: yaml.Node, path: list[str]) -> None:
    """Remove the mapping entry at ``path`` (a list of key names) when it exists."""
    for depth, name in enumerate(path):
        if not isinstance(node, yaml.MappingNode):
            return
        found = [i for i, (key, _) in enumerate(node.value)
                 if isinstance(key, yaml.ScalarNode) and key.value == name]
        if not found:
            return
        if depth == len(path) - 1:
            del node.value[found[0]]
            return
        node = node.value[found[0]][1]


def _compose_file(path: Path, source: str) -> yaml.Node | None:
    """The file's YAML node tree (None when empty); errors become ConfigError."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(FILE_KEY, "does not exist",
                          "check the path; relative paths start at the current directory",
                          source) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(FILE_KEY, f"cannot be read: {exc}", "pass a UTF-8 YAML file",
                          source) from None
    return _compose_text(text, source)


def _compose_text(text: str, source: str) -> yaml.Node | None:
    """The YAML node tree of ``text`` (None when empty); errors become ConfigError."""
    try:
        loader = yaml.SafeLoader(text)      # refuses unprintable characters already
    except yaml.YAMLError as exc:
        raise ConfigError(YAML_KEY, f"invalid YAML: {exc}", "save the file as plain UTF-8 "
                          "text without control characters", source) from None
    loader.name = source  # every mark (and so every line we report) names the file
    try:
        return loader.get_single_node()
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        problem = f"invalid YAML: {exc.problem}"
        if exc.context and exc.context_mark is not None:
            problem += f" ({exc.context} on line {exc.context_mark.line + 1})"
        raise ConfigError(YAML_KEY, problem, "fix indentation, quotes or brackets there",
                          source, mark.line + 1 if mark is not None else None) from None
    except yaml.YAMLError as exc:
        raise ConfigError(YAML_KEY, f"invalid YAML: {exc}", "save the file as plain UTF-8 text",
                          source) from None
    except RecursionError:      # the composer recurses once per nesting level
        raise _too_big("nests deeper than Python's recursion limit", source) from None
    finally:
        loader.dispose()


def _too_big(problem: str, source: str) -> ConfigError:
    return ConfigError(YAML_KEY, problem, "a phalanx config is a few sections of plain "
                       "values: flatten the nesting, or expand the aliases by hand", source)


def _check_size(root: yaml.Node, source: str) -> None:
    """Raise ConfigError when the node tree, aliases expanded, nests deeper than MAX_DEPTH
    or holds more than MAX_NODES values. Iterative and memoized by node, so it costs one
    visit per distinct node whatever the input (an alias back to an enclosing node, a
    cycle, counts once: the constructor refuses those)."""
    done: dict[int, tuple[int, int]] = {}          # node id -> (values, height)
    open_: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        children = _children(node)
        if expanded:
            below = [done.get(id(child), (1, 1)) for child in children]
            values = 1 + sum(v for v, _ in below)
            height = 1 + max((h for _, h in below), default=0)
            if height > MAX_DEPTH:
                raise _too_big(f"nests deeper than {MAX_DEPTH} levels", source)
            if values > MAX_NODES:
                raise _too_big(f"expands to more than {MAX_NODES} values (YAML aliases "
                               "repeated inside each other?)", source)
            done[id(node)] = (values, height)
            open_.discard(id(node))
        elif id(node) not in done and id(node) not in open_:
            open_.add(id(node))
            stack.append((node, True))
            stack += [(child, False) for child in children]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def _reject_duplicates(node: yaml.Node, path: str, source: str, seen: set[int]) -> None:
    """Raise ConfigError at the second occurrence of a key in any one mapping."""
    if id(node) in seen:  # an alias already checked (or a recursive one)
        return
    seen.add(id(node))
    if isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _reject_duplicates(item, f"{path}[{i}]", source, seen)
    elif isinstance(node, yaml.MappingNode):
        first_line: dict[Any, int] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else id(key)
            child = f"{path}.{name}" if path else str(name)
            line = key.start_mark.line + 1
            if name in first_line:
                raise ConfigError(child, f"appears twice in one mapping (first on line "
                                  f"{first_line[name]})", "keep only one of them", source, line)
            first_line[name] = line
            _reject_duplicates(value, child, source, seen)


def _build(cls: type, node: yaml.Node, path: str, origins: _Origins) -> Any:
    """Build section ``cls`` from a mapping node; an empty (null) node means all defaults."""
    if _is_null(node):
        entries: list[tuple[yaml.Node, yaml.Node]] = []
    elif isinstance(node, yaml.MappingNode):
        entries = node.value
    else:
        where = origins.of(path) if path else _Origin(node.start_mark.name,
                                                      node.start_mark.line + 1)
        hint = "write 'key: value' lines under it" if path else "start with a section, e.g. 'job:'"
        raise ConfigError(path or ROOT_KEY, f"is {_shown(node, path, where)}, expected a mapping",
                          hint, where.source, where.line)
    types_ = field_types(cls)
    kwargs: dict[str, Any] = {}
    for key, value in entries:
        name = key.value if isinstance(key, yaml.ScalarNode) else f"<{getattr(key, 'id', 'node')}>"
        child = f"{path}.{name}" if path else name
        where = origins.note(child, key)
        if name not in types_ or not _is_str_key(key):
            section = path or "the top level"
            raise ConfigError(child, f"unknown key{did_you_mean(name, list(types_))}",
                              f"valid keys of {section}: {', '.join(types_)}",
                              where.source, where.line)
        kwargs[name] = _convert(types_[name], value, child, where, origins)
    try:
        return cls(**kwargs)
    except ConfigError as exc:
        raise origins.locate(exc) from None


def _convert(tp: Any, node: yaml.Node, path: str, where: _Origin, origins: _Origins) -> Any:
    """Convert ``node`` to field type ``tp`` or raise ConfigError located at ``where``."""
    if is_section(tp):
        return _build(tp, node, path, origins)
    arms = union_arms(tp)
    if arms:
        for arm in arms:
            try:
                return _convert(arm, node, path, where, origins)
            except ConfigError:
                continue
        raise _type_error(tp, node, path, where)
    origin = typing.get_origin(tp)
    if origin is list:
        if _is_null(node):
            return []
        if not isinstance(node, yaml.SequenceNode):
            raise _type_error(tp, node, path, where)
        item_type = typing.get_args(tp)[0]
        return [_convert(item_type, item, f"{path}[{i}]", where, origins)
                for i, item in enumerate(node.value)]
    if origin is dict:
        if _is_null(node):
            return {}
        if not isinstance(node, yaml.MappingNode):
            raise _type_error(tp, node, path, where)
        value = _construct(node, path, where)
        _check_json(value, path, where)
        return value
    return _convert_scalar(tp, node, path, where)


def _convert_scalar(tp: Any, node: yaml.Node, path: str, where: _Origin) -> Any:
    if not isinstance(node, yaml.ScalarNode):
        raise _type_error(tp, node, path, where)
    value = _construct(node, path, where)
    if typing.get_origin(tp) is Literal:
        if any(type(value) is type(choice) and value == choice for choice in typing.get_args(tp)):
            return value
    elif tp is bool and isinstance(value, bool):
        return value
    elif tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    elif tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value) if abs(value) < 1e300 else math.inf  # huge ints overflow float()
        if math.isfinite(number):  # no setting here means anything at .inf or .nan
            return number
    elif (tp is float and node.style is None and _EXPONENT_FLOAT.fullmatch(node.value)
          and math.isfinite(float(node.value))):
        return float(node.value)
    elif tp is str and isinstance(value, str):
        return value
    elif tp not in (bool, int, float, str):
        raise TypeError(f"the schema type {tp!r} of {path} is not supported by the loader")
    raise _type_error(tp, node, path, where)


def _construct(node: yaml.Node, path: str, where: _Origin) -> Any:
    """The Python value of a node under YAML's safe rules."""
    try:
        return SafeConstructor().construct_object(node, deep=True)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(path, f"cannot be read: {problem}", "remove the YAML tag or quote it",
                          where.source, where.line) from None


def _check_json(value: Any, path: str, where: _Origin) -> None:
    """Raise ConfigError unless ``value`` is JSON-like (the entrypoint receives it as kwargs)."""
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ConfigError(f"{path}.{key}", f"key {key!r} is not a string",
                                  "quote the key", where.source, where.line)
            _check_json(item, f"{path}.{key}", where)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_json(item, f"{path}[{i}]", where)
    elif not isinstance(value, _JSON_TYPES):
        raise ConfigError(path, f"got {value!r} ({type(value).__name__}), expected a JSON value "
                          "(string, number, bool, null, list or mapping)", "quote it",
                          where.source, where.line)


def _type_error(tp: Any, node: yaml.Node, path: str, where: _Origin) -> ConfigError:
    expected = describe(tp)
    hints = {"bool": "write true or false", "int": "write a whole number",
             "float": "write a finite number such as 5 or 2.5", "str": "quote it, e.g. '123'",
             "mapping": "write 'key: value' lines under it"}
    hint = hints.get(expected, "write [a, b] or one '- item' per line"
                     if expected.startswith("list") else f"use {expected}")
    if _is_null(node):
        hint = "give it a value, or delete the key to keep the default"
    return ConfigError(path, f"got {_shown(node, path, where)}, expected {expected}", hint,
                       where.source, where.line)


def _shown(node: yaml.Node, path: str, where: _Origin) -> str:
    """How a wrong value reads in an error: ``'four' (str)``, ``a list``, ``nothing``."""
    if isinstance(node, yaml.SequenceNode):
        return "a list"
    if isinstance(node, yaml.MappingNode):
        return "a mapping"
    if _is_null(node):
        return "nothing (null)"
    value = _construct(node, path, where)
    return f"{value!r} ({type(value).__name__})"


def _is_null(node: yaml.Node) -> bool:
    return isinstance(node, yaml.ScalarNode) and node.tag == _NULL_TAG


def _is_str_key(key: yaml.Node) -> bool:
    return isinstance(key, yaml.ScalarNode) and key.tag == "tag:yaml.org,2002:str"
