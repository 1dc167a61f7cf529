"""The README stays true to the code: its opening commands, and the generated CLI and config
references between their markers (refresh them as the README's "Refreshing" note says)."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from phalanx.configs.reference import render_reference
from phalanx.launcher.cli import build_parser

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]

README = Path(__file__).resolve().parents[2] / "README.md"
FENCE = re.compile(r"^(```|~~~)")
OPENING_LINES = 40


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


def between_markers(text: str, name: str) -> str:
    """The text between ``<!-- name:start -->\\n`` and ``<!-- name:end -->``."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    assert text.count(start) == 1 and text.count(end) == 1, \
        f"README.md needs exactly one {start.strip()} and one {end}"
    head, _, rest = text.partition(start)
    inside, _, _ = rest.partition(end)
    return inside


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
    inside = between_markers(readme_text(), "config-reference")
    expected = render_reference()
    assert inside == expected, (
        "the README's config reference differs from phalanx.configs.reference.render_reference(); "
        "paste the output of `python -m phalanx.configs.reference` between the config-reference "
        "markers:\n" + expected)


def test_cli_reference_names_every_subcommand_and_option() -> None:
    inside = between_markers(readme_text(), "cli-reference")
    commands = subcommands(build_parser())
    assert commands, "build_parser() has no subcommands"
    missing = []
    for path, sub in commands.items():
        if f"phalanx {' '.join(path)} --help" not in inside:
            missing.append(f"`phalanx {' '.join(path)} --help` output")
        for action in sub._actions:
            missing += [f"option {opt} of `{' '.join(path)}`" for opt in action.option_strings
                        if opt not in inside]
    assert not missing, ("the README's CLI reference lacks " + ", ".join(missing)
                         + "; paste `COLUMNS=100 phalanx <subcommand> --help` for each")
