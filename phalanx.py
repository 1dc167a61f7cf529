"""phalanx: checkpointless training for PyTorch. The public API a training script uses."""
from configs.errors import (ConfigError, FatalError, LeaseLost, MembershipUnavailable,
                            PeerUnreachable, PhalanxError, PlanInfeasible, SnapshotCorrupt,
                            SnapshotNotFound, SnapshotUnauthenticated, SparePoolExhausted,
                            TierUnavailable, TransientError, WorkerFailed)
from runtime.context import WorkerContext
from runtime.dcp_storage import TieredStorageReader, TieredStorageWriter
from runtime.session import Session
from runtime.state_tree import RNGState

__all__ = [
    "ConfigError", "FatalError", "LeaseLost", "MembershipUnavailable", "PeerUnreachable",
    "PhalanxError", "PlanInfeasible", "RNGState", "Session", "SnapshotCorrupt",
    "SnapshotNotFound", "SnapshotUnauthenticated", "SparePoolExhausted", "TierUnavailable",
    "TieredStorageReader", "TieredStorageWriter", "TransientError", "WorkerContext",
    "WorkerFailed",
]
