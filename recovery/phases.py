r"""The recovery coordinator's phases: one enum, one allowed-transitions table, and
``PhaseMachine``, which validates, logs and times every change on an injected clock.

    STEADY -> DETECTING -> PLANNING -> FENCING -> PROMOTING -> RESTORING -> RESUMING -> STEADY
                  |            |           \______________________^
                  v            v             (nothing to promote)
               STEADY       DEGRADED -> PLANNING   (capacity came back)
            (false alarm)

    Every recovery phase may go back to DETECTING (a new fault arrived) and every phase but
    FAILED may go to FAILED, which is terminal.
"""
from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from phalanx.recovery.base import InvalidTransition

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    STEADY = "steady"        # training; watching for faults
    DETECTING = "detecting"  # a signal arrived; classifying and collecting more
    PLANNING = "planning"    # computing the recovery plan
    FENCING = "fencing"      # bumping the generation in etcd (CAS) and publishing the plan
    PROMOTING = "promoting"  # promoting spares / starting fresh workers
    RESTORING = "restoring"  # ranks loading the restore step; group re-forming
    RESUMING = "resuming"    # waiting for the first step of the new generation
    DEGRADED = "degraded"    # waiting for capacity (no spare, policy says wait)
    FAILED = "failed"        # terminal: the job stops with a report


ALLOWED: Mapping[Phase, frozenset[Phase]] = MappingProxyType({
    Phase.STEADY: frozenset({Phase.DETECTING, Phase.FAILED}),
    # back to STEADY: the signals classified to no fault (a false alarm)
    Phase.DETECTING: frozenset({Phase.PLANNING, Phase.STEADY, Phase.FAILED}),
    Phase.PLANNING: frozenset({Phase.FENCING, Phase.DEGRADED, Phase.DETECTING, Phase.FAILED}),
    # back to PLANNING: the generation CAS lost a race; RESTORING: nothing to promote
    Phase.FENCING: frozenset({Phase.PROMOTING, Phase.RESTORING, Phase.PLANNING,
                              Phase.DETECTING, Phase.FAILED}),
    Phase.PROMOTING: frozenset({Phase.RESTORING, Phase.DETECTING, Phase.FAILED}),
    Phase.RESTORING: frozenset({Phase.RESUMING, Phase.DETECTING, Phase.FAILED}),
    Phase.RESUMING: frozenset({Phase.STEADY, Phase.DETECTING, Phase.FAILED}),
    Phase.DEGRADED: frozenset({Phase.PLANNING, Phase.DETECTING, Phase.FAILED}),
    Phase.FAILED: frozenset(),
})


@dataclass(frozen=True)
class PhaseChange:
    """One transition: when (clock time), from, to, why, and how long ``from_phase`` lasted."""

    at: float
    from_phase: Phase
    to_phase: Phase
    reason: str
    duration_s: float


class PhaseMachine:
    """The coordinator's current phase. ``transition`` is the only way to change it.

    Starts in STEADY at ``clock()``. Not thread-safe: the coordinator thread owns it.
    """

    def __init__(self, clock: Callable[[], float], initial: Phase = Phase.STEADY,
                 on_change: Callable[[PhaseChange], object] | None = None) -> None:
        self._clock = clock
        self._on_change = on_change
        self._phase = initial
        self._entered_at = clock()
        self._totals: dict[str, float] = {}
        self._history: list[PhaseChange] = []

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def entered_at(self) -> float:
        """Clock time at which the current phase began."""
        return self._entered_at

    @property
    def history(self) -> list[PhaseChange]:
        """Every transition so far, oldest first (a copy)."""
        return list(self._history)

    def can(self, to: Phase) -> bool:
        return to in ALLOWED[self._phase]

    def transition(self, to: Phase, reason: str) -> PhaseChange:
        """Move to ``to``; logs one ``event=phase`` line and closes the current phase's
        timing. Raises InvalidTransition (state unchanged) if ``ALLOWED`` forbids it."""
        if not self.can(to):
            raise InvalidTransition(self._phase.value, to.value, reason)
        now = self._clock()
        change = PhaseChange(now, self._phase, to, reason, now - self._entered_at)
        self._totals[self._phase.value] = self._totals.get(self._phase.value, 0.0) \
            + change.duration_s
        self._history.append(change)
        self._phase, self._entered_at = to, now
        log.info("event=phase from=%s to=%s duration_s=%.6f reason=%r", change.from_phase.value,
                 to.value, change.duration_s, reason)
        if self._on_change is not None:
            self._on_change(change)
        return change

    def timings(self) -> dict[str, float]:
        """Seconds spent in each phase over completed visits (the current one excluded),
        keyed by phase value; phases never left are absent."""
        return dict(self._totals)
