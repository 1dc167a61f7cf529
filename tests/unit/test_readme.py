"""The README and docs/ stay true to the code: the README's opening commands and size, the
generated CLI and config references between their markers in docs/cli.md and
docs/configuration.md (refresh them as each file's "Refreshing" note says), every relative
link, and every ``phalanx.*`` module name the docs mention."""
from __future__ import annotations

import argparse
import functools
import re
import tomllib
from pathlib import Path

import pytest

import phalanx
from phalanx.configs.reference import render_reference
from phalanx.launcher.cli import build_parser

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CONFIG_DOC = DOCS / "configuration.md"
CLI_DOC = DOCS / "cli.md"
FENCE = re.compile(r"^(```|~~~)")
OPENING_LINES = 40
README_MAX_BYTES = 15 * 1024
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
MODULE_NAME = re.compile(r"(?<![\w./-])phalanx(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


def markdown_files() -> list[Path]:
    """README.md and every docs/*.md."""
    return [README, *sorted(DOCS.glob("*.md"))]


def readme_text() -> str:
    return README.read_text(encoding="utf-8")


def first_code_block(text: str) -> tuple[int, list[str]]:
    """(1-based line number of the opening fence, lines inside) of the first fenced block."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if FENCE.match(line.strip())), None)
    assert start is not None, "README.md has no fenced code block"
    fence = FENCE.match(lines[start].strip()).group(1)  # type: ignore[union-attr]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].strip().startswith(fence)),
               None)
    assert end is not None, f"README.md:{start + 1}: code block is never closed"
    return start + 1, lines[start + 1:end]


def between_markers(text: str, name: str, where: str = "README.md") -> str:
    """The text between ``<!-- name:start -->\\n`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    assert text.count(start) == 1 and text.count(end) == 1, \
        f"{where} needs exactly one {start.strip()} and one {end}"
    head, _, rest = text.partition(start)
    inside, _, _ = rest.partition(end)
    return inside


def without_code_blocks(text: str) -> str:
    """``text`` with its fenced code blocks blanked (line numbers kept)."""
    out, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line.strip())
        if fence is None and match:
            fence = match.group(1)
            out.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            out.append("")
        else:
            out.append(line)
    return "\n".join(out)


def github_anchors(text: str) -> set[str]:
    """The anchors GitHub gives the headings of a markdown text (``#some-heading``)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    for line in without_code_blocks(text).splitlines():
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def module_file(parts: list[str]) -> Path | None:
    """The repository file of module ``phalanx.<parts>``: a/b.py or a/b/__init__.py."""
    base = ROOT.joinpath(*parts)
    for candidate in (base.with_name(base.name + ".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@functools.cache
def extension_modules() -> frozenset[str]:
    """Compiled extensions pyproject.toml builds at install time (absent from a fresh clone)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return frozenset(ext["name"] for ext in project["tool"]["setuptools"].get("ext-modules", []))


@functools.cache
def source_text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def unresolved_module_name(name: str) -> str | None:
    """Why ``name`` (``phalanx.a.b[.attr...]``) names nothing in the repo, or None.

    The longest prefix that is a module or package file wins; at least ``phalanx.<pkg>.<module>``
    must exist (a bare ``phalanx.<pkg>`` or a public ``phalanx.<Name>`` is fine), and the first
    part after the module must be a submodule, an extension or a name its source defines."""
    parts = name.split(".")[1:]
    if name in extension_modules():
        return None
    if len(parts) >= 1 and parts[0] in phalanx.__all__:
        return None
    if len(parts) == 1:
        return None if module_file(parts) is not None else f"no package {parts[0]}/"
    for k in range(len(parts), 1, -1):
        found = module_file(parts[:k])
        if found is None:
            continue
        if k == len(parts):
            return None
        attribute = parts[k]
        if re.search(rf"\b{re.escape(attribute)}\b", source_text(found)):
            return None
        return f"{found.relative_to(ROOT)} has no {attribute!r}"
    return f"no module {'/'.join(parts[:2])}.py or {'/'.join(parts[:2])}/__init__.py"


def subcommands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
                ) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    """Every (nested) subcommand of ``parser`` by its word path, e.g. ("ckpt", "ls")."""
    found: dict[tuple[str, ...], argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[path + (name,)] = sub
                found.update(subcommands(sub, path + (name,)))
    return found


def test_opens_with_make_demo_and_make_test() -> None:
    fence_line, block = first_code_block(readme_text())
    code = "\n".join(block)
    for command in ("make demo", "make test"):
        assert re.search(rf"(^|\s){command}(\s|$)", code, re.M), \
            f"README.md's first code block (line {fence_line}) lacks `{command}`"
        line = fence_line + 1 + next(i for i, text in enumerate(block) if command in text)
        assert line <= OPENING_LINES, f"`{command}` is on line {line}, after line {OPENING_LINES}"


def test_config_reference_is_generated_text() -> None:
    inside = between_markers(CONFIG_DOC.read_text(encoding="utf-8"), "config-reference",
                             "docs/configuration.md")
    expected = render_reference()
    assert inside == expected, (
        "docs/configuration.md's config reference differs from "
        "phalanx.configs.reference.render_reference(); paste the output of "
        "`python -m phalanx.configs.reference` between its config-reference markers:\n" + expected)


def test_cli_reference_names_every_subcommand_and_option() -> None:
    inside = between_markers(CLI_DOC.read_text(encoding="utf-8"), "cli-reference", "docs/cli.md")
    commands = subcommands(build_parser())
    assert commands, "build_parser() has no subcommands"
    missing = []
    for path, sub in commands.items():
        if f"phalanx {' '.join(path)} --help" not in inside:
            missing.append(f"`phalanx {' '.join(path)} --help` output")
        for action in sub._actions:
            missing += [f"option {opt} of `{' '.join(path)}`" for opt in action.option_strings
                        if opt not in inside]
    assert not missing, ("docs/cli.md's CLI reference lacks " + ", ".join(missing)
                         + "; paste `COLUMNS=100 phalanx <subcommand> --help` for each")


def test_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move reference material into docs/ "
        "and link it from the README's Links section")


def test_relative_links_point_at_existing_files() -> None:
    broken = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(without_code_blocks(text).splitlines(), 1):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):     # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                where = f"{path.relative_to(ROOT)}:{number}: ({target})"
                if not linked.exists():
                    broken.append(f"{where} names no file")
                elif anchor and linked.suffix == ".md" and anchor not in github_anchors(
                        linked.read_text(encoding="utf-8")):
                    broken.append(f"{where} names no heading of {linked.relative_to(ROOT)}")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_module_names_exist() -> None:
    stale = []
    for path in markdown_files():
        text = path.read_text(encoding="utf-8")
        for number, line in enumerate(text.splitlines(), 1):
            for name in MODULE_NAME.findall(line):
                why = unresolved_module_name(name)
                if why is not None:
                    stale.append(f"{path.relative_to(ROOT)}:{number}: {name}: {why}")
    assert not stale, "module names that do not exist:\n" + "\n".join(stale)
