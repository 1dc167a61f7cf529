"""The native fused copy (runtime/fused_copy.c): its digest is python-xxhash's XXH3-128 of
the bytes it copied, for any length and alignment; it is built once and shared; where it
cannot be built, ``kernel()`` is None and says why."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from runtime import fused_copy

pytestmark = pytest.mark.unit

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                              reason="no C compiler here: the native kernel cannot be built")


@needs_cc
@settings(max_examples=80, deadline=None)
@given(data=st.binary(max_size=200_000), src_skew=st.integers(0, 63),
       dst_skew=st.integers(0, 63))
def test_the_digest_is_xxh3_128_of_the_copied_bytes(data: bytes, src_skew: int,
                                                    dst_skew: int) -> None:
    native = fused_copy.kernel()
    assert native is not None
    src = ctypes.create_string_buffer(b"\xaa" * src_skew + data, src_skew + len(data))
    dst = ctypes.create_string_buffer(b"\x55" * (dst_skew + len(data) + 8))
    got = native.copy_digest(ctypes.addressof(dst) + dst_skew, ctypes.addressof(src) + src_skew,
                             len(data))
    assert got == xxhash.xxh3_128_digest(data)
    raw = dst.raw
    assert raw[dst_skew:dst_skew + len(data)] == data
    assert raw[:dst_skew] == b"\x55" * dst_skew                         # nothing outside
    assert raw[dst_skew + len(data):dst_skew + len(data) + 8] == b"\x55" * 8


@needs_cc
def test_the_stream_copy_copies_exactly() -> None:
    native = fused_copy.kernel()
    assert native is not None
    data = os.urandom(3 * 32768 + 77)
    src = ctypes.create_string_buffer(data, len(data))
    dst = ctypes.create_string_buffer(len(data) + 2)
    native.stream_copy(ctypes.addressof(dst) + 1, ctypes.addressof(src), len(data))
    assert dst.raw[1:-1] == data and dst.raw[0] == 0 and dst.raw[-1] == 0


@needs_cc
def test_concurrent_first_builds_agree_on_one_library(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_NATIVE_DIR", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:
        paths = list(pool.map(lambda _: fused_copy._build(), range(4)))
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [paths[0].name]      # no temp files left
    assert fused_copy._load(paths[0]).path == paths[0]


def test_no_compiler_means_the_python_path_and_a_reason(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PHALANX_NATIVE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-cc-for-phalanx")
    with caplog.at_level(logging.WARNING, logger="runtime.fused_copy"):
        assert fused_copy.kernel.__wrapped__() is None
    assert "no C compiler 'no-such-cc-for-phalanx'" in caplog.text
    assert "fallback=python" in caplog.text


def test_a_failing_build_means_the_python_path_and_the_compiler_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C;\n")
    monkeypatch.setattr(fused_copy, "SOURCE", broken)
    monkeypatch.setenv("PHALANX_NATIVE_DIR", str(tmp_path / "out"))
    if shutil.which(os.environ.get("CC", "cc")) is None:
        pytest.skip("no C compiler here to fail")
    with caplog.at_level(logging.WARNING, logger="runtime.fused_copy"):
        assert fused_copy.kernel.__wrapped__() is None
    assert "failed on" in caplog.text and "broken.c" in caplog.text
    assert list((tmp_path / "out").iterdir()) == []                    # no half-built library


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_NATIVE", "0")
    assert fused_copy.kernel.__wrapped__() is None
