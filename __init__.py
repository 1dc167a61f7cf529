"""phalanx: checkpointless training for PyTorch. The public API a training script uses.

User code imports only this package: ``phalanx.Session``, ``phalanx.TieredStorageWriter``,
the error tree. The names are resolved on first use (PEP 562), so ``import phalanx.configs``
or ``phalanx --version`` does not import torch: the launcher's control plane and the CLI stay
light, and a training script pays for torch once, as it would anyway.
"""
from __future__ import annotations

import importlib
from importlib import metadata
from typing import TYPE_CHECKING, Any

try:
    __version__ = metadata.version("phalanx")
except metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "phalanx.configs.errors": (
        "ConfigError", "FatalError", "LeaseLost", "MembershipUnavailable", "PeerUnreachable",
        "PhalanxError", "PlanInfeasible", "SnapshotCorrupt", "SnapshotNotFound",
        "SnapshotUnauthenticated", "SparePoolExhausted", "TierUnavailable", "TransientError",
        "WorkerFailed"),
    "phalanx.runtime.context": ("WorkerContext",),
    "phalanx.runtime.dcp.storage": ("TieredStorageReader", "TieredStorageWriter"),
    "phalanx.runtime.worker.session": ("Session",),
    "phalanx.runtime.snapshot.state_tree": ("RNGState",),
}
_HOME = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [
    "ConfigError", "FatalError", "LeaseLost", "MembershipUnavailable", "PeerUnreachable",
    "PhalanxError", "PlanInfeasible", "RNGState", "Session", "SnapshotCorrupt",
    "SnapshotNotFound", "SnapshotUnauthenticated", "SparePoolExhausted", "TierUnavailable",
    "TieredStorageReader", "TieredStorageWriter", "TransientError", "WorkerContext",
    "WorkerFailed", "__version__",
]

if TYPE_CHECKING:
    from phalanx.configs.errors import (ConfigError, FatalError, LeaseLost,
                                        MembershipUnavailable, PeerUnreachable, PhalanxError,
                                        PlanInfeasible, SnapshotCorrupt, SnapshotNotFound,
                                        SnapshotUnauthenticated, SparePoolExhausted,
                                        TierUnavailable, TransientError, WorkerFailed)
    from phalanx.runtime.dcp.storage import TieredStorageReader, TieredStorageWriter
    from phalanx.runtime.snapshot.state_tree import RNGState
    from phalanx.runtime.context import WorkerContext
    from phalanx.runtime.worker.session import Session


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'phalanx' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))
