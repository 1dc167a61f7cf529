"""The native fused copy + XXH3-128 of snapshot capture (``fused_copy.c``): built at install
time as the optional extension ``phalanx.runtime.snapshot._fused_copy``, loaded with ctypes,
and absent (``kernel()`` is None, the pure-Python path takes over) wherever the install had
no C compiler or the library does not load.

Why native: the Python loop copies a 1 MiB leaf and then hashes it back, a memcpy (read the
source, read-for-ownership and write the slot) plus the hash. The kernel hashes each 32 KiB
piece of the source while it is in L1 and streams it to the slot, so memory sees the source
once and the slot once. Measured on the 2-core CI machine, 2 threads, 64 MiB-1 GiB, against
a 2-thread libc memcpy (numpy ``copyto``): Python loop 0.77-0.81, kernel 0.95-1.26.

The XXH3 functions are python-xxhash's exported ones, so the digests are the very ones the
Python path computes (``tests/unit/test_fused_copy.py`` checks they agree). The library has
no Python module init: it is a plain shared object that setuptools' ``build_ext`` compiles
and installs beside this file. ``PHALANX_NATIVE=0`` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import logging
import os
from pathlib import Path

import xxhash
import xxhash._xxhash as _xxhash_ext

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("fused_copy.c")
LIBRARY = "_fused_copy"
_XXH_SYMBOLS = ("XXH3_createState", "XXH3_freeState", "XXH3_128bits_reset",
                "XXH3_128bits_update_dispatch", "XXH3_128bits_digest")


class _XxhApi(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p)
                for name in ("create", "release", "reset", "update", "digest")]


class Kernel:
    """The loaded library. Its calls release the GIL (ctypes), so threads run in parallel."""

    def __init__(self, lib: ctypes.CDLL, api: _XxhApi, path: Path) -> None:
        self.path = path
        self._api = api                   # kept alive: the library reads it on every call
        self._copy_digest = lib.phalanx_copy_digest
        self._copy_digest.argtypes = [ctypes.POINTER(_XxhApi), ctypes.c_void_p,
                                      ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        self._copy_digest.restype = ctypes.c_int
        self._stream_copy = lib.phalanx_stream_copy
        self._stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        self._stream_copy.restype = None

    def copy_digest(self, dst: int, src: int, n: int) -> bytes:
        """Copy ``n`` bytes from address ``src`` to address ``dst``; their XXH3-128 digest
        (the bytes ``xxhash.xxh3_128_digest`` returns). The caller keeps both alive."""
        out = ctypes.create_string_buffer(16)
        if self._copy_digest(ctypes.byref(self._api), dst, src, n, out) != 0:
            raise MemoryError("fused copy: cannot allocate an XXH3 state")
        return out.raw

    def stream_copy(self, dst: int, src: int, n: int) -> None:
        """The kernel's copy alone (non-temporal stores), for the bench's copy limit."""
        self._stream_copy(dst, src, n)


@functools.cache
def kernel() -> Kernel | None:
    """The native kernel, loaded once per process; None when turned off, not built at install
    time, or not loadable (logged once with the reason)."""
    if os.environ.get("PHALANX_NATIVE", "1") == "0":
        return None
    try:
        return _load(library())
    except (OSError, AttributeError, ValueError) as exc:
        log.warning("event=fused_copy_unavailable reason=%r fallback=python", str(exc))
        return None


def library() -> Path:
    """The installed library's path; OSError naming the fix when the install built none."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = SOURCE.with_name(LIBRARY + suffix)
        if path.exists():
            return path
    raise OSError(f"{LIBRARY} was not built when phalanx was installed (no C compiler?); "
                  f"install gcc or cc and reinstall phalanx to get the native copy")


def _load(path: Path) -> Kernel:
    ext = ctypes.CDLL(_xxhash_ext.__file__)
    api = _XxhApi(*(ctypes.cast(getattr(ext, symbol), ctypes.c_void_p).value
                    for symbol in _XXH_SYMBOLS))
    loaded = Kernel(ctypes.CDLL(str(path)), api, path)
    probe = bytes(range(256)) * 300             # spans pieces and a ragged tail
    src = ctypes.create_string_buffer(probe, len(probe))
    dst = ctypes.create_string_buffer(len(probe))
    got = loaded.copy_digest(ctypes.addressof(dst) + 3, ctypes.addressof(src) + 1,
                             len(probe) - 5)
    if got != xxhash.xxh3_128_digest(probe[1:-4]) or dst.raw[3:-2] != probe[1:-4]:
        raise ValueError(f"fused copy built at {path} disagrees with python-xxhash")
    return loaded
