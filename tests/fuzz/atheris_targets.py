"""Coverage-guided fuzzing of phalanx's parsers with atheris (libFuzzer), where installed.

Not collected by pytest (no ``test_`` prefix); the Hypothesis tests in
``tests/unit/test_fuzz_parsers.py`` run the same checks in CI. Usage::

    .venv/bin/pip install atheris            # needs clang/libFuzzer; often unavailable
    .venv/bin/python tests/fuzz/atheris_targets.py manifest -max_total_time=600
    .venv/bin/python tests/fuzz/atheris_targets.py payload|frames|config [libFuzzer flags]

A target fails (and libFuzzer writes a crash-* reproducer) when a parser raises anything
but its documented error, exactly as the Hypothesis checks do.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.unit.test_fuzz_parsers import (_check_config, _check_frames,  # noqa: E402
                                          _check_manifest, _check_payload)

TARGETS: dict[str, Callable[[bytes], None]] = {
    "manifest": _check_manifest,
    "payload": _check_payload,
    "frames": _check_frames,
    "config": lambda data: _check_config(data.decode("utf-8", "replace")),
}


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[1] not in TARGETS:
        print(f"usage: {argv[0]} {{{','.join(TARGETS)}}} [libFuzzer flags]", file=sys.stderr)
        return 2
    try:
        import atheris
    except ImportError:
        print("atheris is not installed (pip install atheris; it needs clang's libFuzzer); "
              "run tests/unit/test_fuzz_parsers.py with PHALANX_FUZZ_EXAMPLES=20000 instead",
              file=sys.stderr)
        return 2
    target = TARGETS[argv[1]]
    atheris.Setup([argv[0], *argv[2:]], target)
    atheris.Fuzz()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
