"""The launcher's run observer (``phalanx.launcher.run_observer``): one ``rank_restored``
event per rank and recovery, from the rank's final restore record."""
from __future__ import annotations

from pathlib import Path

import pytest

from phalanx.launcher.events import EventLog
from phalanx.launcher.run_observer import RunObserver
from phalanx.runtime.base import MemberRecord

pytestmark = pytest.mark.unit


def _member(restored: dict) -> MemberRecord:
    return MemberRecord("w0-g0", 0, "node0", step=20, generation=1,
                        extra={"restored": restored})


def test_a_heal_is_reported_from_its_final_record_not_the_one_before_the_survivors_sent(
        tmp_path: Path) -> None:
    """A healing rank publishes its restore twice: once its per-rank state is loaded (so
    the other ranks stop waiting for it), then with the replicated state received. The
    first has no source yet; reported, the drill printed ``restored from ['own',
    'unknown']`` for a survivor healed from its own keeper."""
    events = EventLog(tmp_path / "events.jsonl")
    observer = RunObserver(events, lambda generation: {0: ["node1"]})
    observer.poll({"w0-g0": _member({"generation": 1, "step": 20, "healing": True})}, {"w0-g0"})
    assert [e for e in events.events if e["event"] == "rank_restored"] == []
    final = {"generation": 1, "step": 20, "source": "keeper node0", "healed": True,
             "bytes": 0, "seconds": 0.41}
    for _ in range(2):                          # once per rank and generation
        observer.poll({"w0-g0": _member(final)}, {"w0-g0"})
    (restored,) = [e for e in events.events if e["event"] == "rank_restored"]
    assert (restored["source"], restored["source_kind"], restored["step"]) == \
        ("keeper node0", "own", 20)
