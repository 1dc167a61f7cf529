"""The config reference: a markdown table per section, generated from the schema.

``python -m phalanx.configs.reference`` prints it; docs/configuration.md embeds the same text.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from phalanx.configs.introspect import describe, field_types, is_section, walk_leaves
from phalanx.configs.schema import PhalanxConfig

_INTRO = ("Every key below can be written in the YAML file, passed as `--set key=value` "
          "(the value is read as YAML: `4`, `auto`, `[a:1, b:2]`) or listed in the "
          "`PHALANX_SET` environment variable (`a.b=c;d.e=f`). Unknown keys are errors.")


def render_reference(root: type = PhalanxConfig) -> str:
    """Markdown: one table per top-level section (key, type, default, description)."""
    parts = [_INTRO, ""]
    section_docs = _top_level_docs(root)
    for section, doc_text in section_docs.items():
        parts.append(f"### `{section}` — {doc_text}" if doc_text else f"### `{section}`")
        parts.append("")
        parts.append("| key | type | default | description |")
        parts.append("|---|---|---|---|")
        for leaf in walk_leaves(field_types(root)[section], section):
            parts.append(f"| `{leaf.path}` | {_cell(describe(leaf.type))} | "
                         f"{_default_cell(leaf.default)} | {_cell(leaf.doc)} |")
        parts.append("")
    return "\n".join(parts).rstrip("\n") + "\n"


def _top_level_docs(root: type) -> dict[str, str]:
    """Each top-level section's name and doc, in declaration order."""
    types_ = field_types(root)
    return {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(root)
            if is_section(types_.get(f.name))}


def _default_cell(value: Any) -> str:
    """A default as YAML would spell it: `true`, `0.5`, `""`, `[]`, `{}`."""
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value if value else '""'
    elif isinstance(value, (list, dict)):
        text = "[]" if value == [] else "{}" if value == {} else repr(value)
    else:
        text = repr(value)
    return "`" + text.replace("|", "\\|") + "`"  # inside code only '|' needs escaping


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    for char in "|<>":  # a bare <name> would be read as an HTML tag
        text = text.replace(char, "\\" + char)
    return text.replace("\n", " ")


def main() -> None:
    """Print the reference (docs/configuration.md's reference section is generated from this)."""
    print(render_reference(), end="")


if __name__ == "__main__":
    main()
