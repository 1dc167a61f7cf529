"""``--set key=value`` and ``PHALANX_SET`` overrides: parsed, checked against the schema and
spliced into the composed YAML tree before it is converted, so they get the file's checks.
"""
from __future__ import annotations

import re
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import yaml
from yaml.error import Mark

from phalanx.configs.errors import ConfigError
from phalanx.configs.introspect import describe, did_you_mean, field_types, is_section

SET_SOURCE = "--set"
ENV_VAR = "PHALANX_SET"
_STR_TAG = "tag:yaml.org,2002:str"
_MAP_TAG = "tag:yaml.org,2002:map"
_NULL_TAG = "tag:yaml.org,2002:null"
_HINT = "write section.key=value, e.g. job.world_size=4 or etcd.endpoints=[host:2379]"
_ENV_HINT = (f"{ENV_VAR} holds section.key=value assignments separated by ';', e.g. "
             f"{ENV_VAR}='spares.count=0;job.world_size=4'")
# a second assignment glued to a value with another separator: `a.b=1,c.d=2`, `a.b=1 c.d=2`
_JOINED = re.compile(r"[,\s|&]+([A-Za-z_][\w-]*)((?:\.[\w-]+)+)=")


@dataclass(frozen=True)
class Override:
    """One ``path=value`` assignment; ``value`` is the composed YAML of the right side."""

    path: tuple[str, ...]
    value: yaml.Node
    source: str


def parse_override(text: str, source: str = SET_SOURCE) -> Override:
    """Parse ``a.b=value``; the value is a YAML scalar or flow value (``4``, ``auto``, ``[a, b]``).

    Raises ConfigError (source ``source``, no line) when there is no '=', the key is empty
    or has an empty part, or the value is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep:
        raise ConfigError(key or repr(text), "has no '=' and so no value", _HINT, source)
    segments = tuple(key.split("."))
    if not key or not all(segments):
        raise ConfigError(key or repr(text), "is not a dotted key path", _HINT, source)
    try:
        node = yaml.compose(raw, Loader=yaml.SafeLoader)
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(key, f"value {raw!r} is not valid YAML: {problem}",
                          "quote the value or write a flow list such as [a, b]", source) from None
    if node is None:  # `key=` sets an empty (null) value
        node = yaml.ScalarNode(_NULL_TAG, "")
    return Override(segments, node, source)


def overrides_from_env(env: Mapping[str, str], sections: Sequence[str] = ()) -> list[Override]:
    """The overrides in ``PHALANX_SET="a.b=c;d.e=f"`` (empty parts skipped), in order.

    Raises ConfigError (source PHALANX_SET) for a malformed part, with a hint naming the
    ';' separator; a part whose value holds another ``section.key=`` assignment (one of
    ``sections``) glued on with ',' or a space is refused as such."""
    text = env.get(ENV_VAR, "")
    found = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        key, _, raw = part.partition("=")
        glued = next((m for m in _JOINED.finditer(raw) if m.group(1) in sections), None)
        if glued is not None:
            raise ConfigError(key.strip(), f"value {raw!r} holds a second assignment "
                              f"({glued.group(1)}{glued.group(2)}=...) after "
                              f"{glued.group(0)[0]!r}", _ENV_HINT, ENV_VAR)
        try:
            found.append(parse_override(part, ENV_VAR))
        except ConfigError as exc:
            raise ConfigError(exc.key, exc.problem, _ENV_HINT, ENV_VAR) from None
    return found


def collect_overrides(root_cls: type, overrides: Sequence[str],
                      env: Mapping[str, str]) -> list[Override]:
    """Environment overrides then ``--set`` overrides (the command line wins), all checked."""
    if isinstance(overrides, str):  # a lone string would be split into characters
        overrides = [overrides]
    found = overrides_from_env(env, list(field_types(root_cls))) + [
        parse_override(text) for text in overrides]
    for override in found:
        check_path(root_cls, override)
    return found


def check_path(root_cls: type, override: Override) -> None:
    """Raise ConfigError unless the override's path names a schema key.

    A path may continue below a mapping-typed key (``job.args.steps``): those parts are
    keys inside the mapping, free-form.
    """
    cls = root_cls
    for i, segment in enumerate(override.path):
        types_ = field_types(cls)
        so_far = ".".join(override.path[: i + 1])
        if segment not in types_:
            section = ".".join(override.path[:i]) or "the top level"
            raise ConfigError(so_far, f"unknown key{did_you_mean(segment, list(types_))}",
                              f"valid keys of {section}: {', '.join(types_)}", override.source)
        tp = types_[segment]
        if is_section(tp):
            cls = tp
        elif typing.get_origin(tp) is dict:
            return
        elif i < len(override.path) - 1:
            raise ConfigError(so_far, f"is a {describe(tp)} value, not a section",
                              f"write {so_far}=VALUE", override.source)


def apply_override(root: yaml.MappingNode, override: Override) -> None:
    """Set ``override.path`` in the mapping tree ``root``, creating sections as needed.

    The key nodes it writes carry a mark named after the override's source with line -1,
    which the loader reads as "this key came from --set / PHALANX_SET, no line".
    """
    mark = Mark(override.source, 0, -1, 0, None, 0)
    node = root
    last = len(override.path) - 1
    for i, segment in enumerate(override.path):
        index = _find(node, segment)
        if i == last:
            child: yaml.Node = override.value
        elif index is not None and isinstance(node.value[index][1], yaml.MappingNode):
            node = node.value[index][1]
            continue
        else:
            child = yaml.MappingNode(_MAP_TAG, [], mark, mark)
        entry = (yaml.ScalarNode(_STR_TAG, segment, mark, mark), child)
        if index is None:
            node.value.append(entry)
        else:
            node.value[index] = entry
        if isinstance(child, yaml.MappingNode):
            node = child


def _find(node: yaml.MappingNode, name: str) -> int | None:
    """Index of the entry whose key is the plain string ``name``, else None."""
    for index, (key, _value) in enumerate(node.value):
        if isinstance(key, yaml.ScalarNode) and key.value == name:
            return index
    return None
