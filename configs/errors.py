"""The one error tree of phalanx: every error a user or operator can see.

Transient errors may succeed on retry (a peer, etcd or a lease); fatal errors need a
change (config, data, capacity). Every error pickles (they cross Ray) because each keeps
its constructor arguments in ``args``.
"""
from __future__ import annotations


class PhalanxError(Exception):
    """Root of every phalanx error."""


class TransientError(PhalanxError):
    """May succeed when retried: a peer, etcd or a lease was briefly unavailable."""


class FatalError(PhalanxError):
    """Will not succeed on retry: the input, the data or the capacity must change."""


class PeerUnreachable(TransientError):
    """A keeper or worker could not be reached over TCP."""


class MembershipUnavailable(TransientError):
    """etcd did not answer within the configured timeout."""


class LeaseLost(TransientError):
    """Our etcd lease expired or was revoked: we are no longer a member."""


class StaleGeneration(FatalError):
    """A write carried an older generation than the current one (fenced)."""


class SnapshotCorrupt(FatalError):
    """A snapshot's bytes do not match its recorded checksum or layout."""


class SnapshotUnauthenticated(FatalError):
    """A snapshot's manifest HMAC is missing or wrong for this job's secret."""


class SnapshotNotFound(FatalError):
    """No source holds the requested (rank, step)."""


class SnapshotOfOtherRun(SnapshotNotFound):
    """A tier's files of a step belong to another run of the job (a relaunch into the same
    tier path): never restored, committed or deleted as this run's."""


class ResumeRefused(FatalError):
    """``phalanx launch --resume`` found no checkpoint to resume from, or one that does not
    fit this launch (world size, HMAC, checksums)."""


class TierUnavailable(TransientError):
    """A persistent tier (disk, S3) refused a read or a write."""


class PlanInfeasible(FatalError):
    """The planner found no way to recover (no source, no spare, policy says fail)."""


class SparePoolExhausted(FatalError):
    """A spare was needed and none was left."""


class WorkerFailed(FatalError):
    """A worker's entrypoint raised; ``traceback_text`` holds the worker's traceback.
    ``peer_failure``: why the rank's default group had failed before it raised (a peer
    died or left), empty when it had not: the script raised because of another rank's
    fault, not a bug of its own."""

    def __init__(self, rank: int, message: str, traceback_text: str = "",
                 peer_failure: str = "") -> None:
        super().__init__(rank, message, traceback_text, peer_failure)
        self.rank = rank
        self.message = message
        self.traceback_text = traceback_text
        self.peer_failure = peer_failure

    def __str__(self) -> str:
        return f"rank {self.rank} failed: {self.message}\n{self.traceback_text}".rstrip()


class InjectedFault(RuntimeError):
    """Raised inside a worker's step by a drill's ``worker_exception`` fault (SIGUSR1)."""


class ReplicasNeverAgreed(FatalError):
    """The replicated state differed across ranks before any step ever agreed: the ranks did
    not start from the same state (e.g. unseeded initialisation without a broadcast), which
    no repair or rollback can fix. Not silent corruption."""


class StateNotCapturable(FatalError):
    """The training loop holds state a snapshot cannot capture (gradients accumulated across
    ``session.step()`` calls): a restore would silently lose it. The message names the
    state and the fix (docs/porting.md, "What the loop must not do")."""


class PlacementUnsupported(FatalError, TypeError):
    """Registered state holds a DTensor whose placement a snapshot cannot capture (only
    ``Shard(dim)`` and ``Replicate()`` are): raised at the first snapshot, naming the path,
    the placement and the fix. A TypeError too, like any value a snapshot cannot flatten."""


class ReshardUnsupported(FatalError):
    """A snapshot of sharded state (DTensor local shards) does not fit the live DeviceMesh
    (another world size, mesh shape, dim names or rank coordinate): resharding a snapshot
    is not supported. The message names both meshes."""


class ServiceStartError(FatalError):
    """An embedded service (etcd, Ray) did not start or did not become healthy."""


class ConfigError(FatalError):
    """A config value is missing, unknown, mistyped or inconsistent.

    ``key`` is the dotted path (``etcd.heartbeat_s``), ``source`` the file (or
    ``--set``), ``line`` the 1-based YAML line when known, ``hint`` what to do.
    """

    def __init__(self, key: str, problem: str, hint: str = "", source: str = "",
                 line: int | None = None) -> None:
        super().__init__(key, problem, hint, source, line)
        self.key = key
        self.problem = problem
        self.hint = hint
        self.source = source
        self.line = line

    def located(self, source: str, line: int | None) -> "ConfigError":
        """The same error with its file and line filled in (kept if already set)."""
        return ConfigError(self.key, self.problem, self.hint,
                           self.source or source, self.line if self.line is not None else line)

    def __str__(self) -> str:
        where = self.source or "<config>"
        if self.line is not None:
            where += f":{self.line}"
        text = f"{where}: {self.key}: {self.problem}"
        if self.hint:
            text += f" (hint: {self.hint})"
        return text
