"""Retrying the transient steps of a recovery within one deadline: an etcd blip
(``MembershipUnavailable``), a keeper that is alive but too busy to answer a Ray call in
time (``GetTimeoutError``, ``ActorUnavailableError``). Past the deadline the recovery fails
with ``RecoveryStalled`` naming the step and the last error; a lost leadership, checked
between tries, stops it at once."""
from __future__ import annotations

import logging
from typing import Callable, TypeVar

from ray.exceptions import ActorUnavailableError, GetTimeoutError

from phalanx.configs.errors import FatalError, LeaseLost, TransientError

log = logging.getLogger(__name__)
T = TypeVar("T")
FIRST_DELAY_S = 0.05       # first pause between tries, doubling up to MAX_DELAY_S
MAX_DELAY_S = 1.0
# what may succeed when tried again; LeaseLost is transient for a worker (it joins again)
# but never arises from the unleased writes a recovery makes
RETRIED = (TransientError, GetTimeoutError, ActorUnavailableError)


class RecoveryStalled(FatalError):
    """A step of a recovery kept failing with transient errors (etcd unreachable, a keeper
    not answering) until the recovery's deadline."""


def retry_transient(op: Callable[[], T], what: str, deadline: float, deadline_s: float,
                    clock: Callable[[], float], sleep: Callable[[float], None],
                    check: Callable[[], None] = lambda: None) -> T:
    """``op()``, tried again after each transient error until ``deadline`` (on ``clock``);
    ``check()`` runs before every new try (it raises ``LeadershipLost`` when this launcher
    no longer leads). Raises ``RecoveryStalled`` past the deadline; any other error of
    ``op`` passes through at once. ``deadline_s`` is the budget, named in the message."""
    delay, tries = FIRST_DELAY_S, 0
    while True:
        tries += 1
        try:
            return op()
        except RETRIED as exc:
            if isinstance(exc, LeaseLost):
                raise
            now = clock()
            if now >= deadline:
                raise RecoveryStalled(
                    f"{what} failed {tries} time(s) within the recovery's {deadline_s:g} s "
                    f"(recovery.group_timeout_s); last error: {type(exc).__name__}: "
                    f"{str(exc)[:300]}; check that etcd and the keepers are reachable and "
                    "not overloaded, or raise recovery.group_timeout_s") from exc
            log.warning("event=recovery_retry what=%r try=%d error=%s", what, tries,
                        f"{type(exc).__name__}: {str(exc)[:200]}")
        try:
            check()
        except TransientError as exc:   # etcd unreachable for this check too: next try
            log.warning("event=leadership_unchecked error=%s", exc)
        sleep(max(0.0, min(delay, deadline - clock())))
        delay = min(delay * 2, MAX_DELAY_S)
