"""The native fused copy (runtime/snapshot/fused_copy.c): its digest is python-xxhash's XXH3-128 of
the bytes it copied, for any length and alignment; the install builds it; where it was not
built or does not load, ``kernel()`` is None and says why."""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings, strategies as st

from phalanx.runtime.snapshot import fused_copy

pytestmark = pytest.mark.unit

needs_cc = pytest.mark.skipif(shutil.which(os.environ.get("CC", "cc")) is None,
                              reason="no C compiler here: the install built no native kernel")


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
def test_the_install_built_the_library_and_kernel_loads_it() -> None:
    path = fused_copy.library()
    assert path.parent == fused_copy.SOURCE.parent and path.name.startswith("_fused_copy")
    loaded = fused_copy.kernel.__wrapped__()
    assert loaded is not None and loaded.path == path


def test_no_library_means_the_python_path_and_the_fix(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(fused_copy, "LIBRARY", "_no_such_library_for_phalanx")
    with caplog.at_level(logging.WARNING, logger="phalanx.runtime.snapshot.fused_copy"):
        assert fused_copy.kernel.__wrapped__() is None
    assert "was not built when phalanx was installed" in caplog.text
    assert "reinstall phalanx" in caplog.text and "fallback=python" in caplog.text


def test_an_unloadable_library_means_the_python_path(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    suffix = fused_copy.importlib.machinery.EXTENSION_SUFFIXES[0]
    (tmp_path / f"_fused_copy{suffix}").write_bytes(b"not an ELF file")
    monkeypatch.setattr(fused_copy, "SOURCE", tmp_path / "fused_copy.c")
    with caplog.at_level(logging.WARNING, logger="phalanx.runtime.snapshot.fused_copy"):
        assert fused_copy.kernel.__wrapped__() is None
    assert "fused_copy_unavailable" in caplog.text and "fallback=python" in caplog.text


def test_turned_off_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PHALANX_NATIVE", "0")
    assert fused_copy.kernel.__wrapped__() is None
