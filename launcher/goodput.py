r"""Goodput: how a run's wall time divides into start-up, productive steps, steps redone after
a rollback, each recovery phase, waiting for capacity, snapshot stalls and shutdown. Pure:
computed from the run's events (``events.jsonl`` records) and the launch's start and end.

The wall window [start, end) is cut at every measured boundary; each piece goes to the
measured window of highest priority that covers it, the rest is training time:

    start      first step          fault      first step of g+1        training end   end
      |--startup--|----training-----|detect|planning|..|restoring|--training--|--shutdown--|
                                    \______ recovery phases (phase events) __/

    priority: a recovery's ranks already stepping (first step of g+1 -> back in STEADY)
            > recovery phases, waiting for capacity > startup > shutdown > training

Training time is then split into the snapshot stall the ranks reported, the steps redone
after rollbacks (``lost_steps`` x the mean step time of the training time) and productive
time, the remainder. Every part but productive is measured, so the parts sum to the wall
time exactly (up to rounding) and ``effective = productive / wall``.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Mapping, Sequence

Event = Mapping[str, Any]
PRIORITY = {"training": 0, "recovery": 1, "waiting_for_capacity": 1, "startup": 2,
            "shutdown": 3}
WAITING_PHASE = "degraded"            # the coordinator's phase while it waits for capacity
NOT_RECOVERY = ("steady", "failed")   # phases that are not a recovery's
# how renderings order recovery phases (JSON objects may come back key-sorted)
PHASE_ORDER = ("notice", "detect", "detecting", "planning", "fencing", "promoting", "restoring",
               "resuming", "restart", "import", "init_and_load", "first_step")
REDONE_FROM = "lost_steps x mean step time (training time less snapshot stalls / steps computed)"
ROUND = 4


@dataclass(frozen=True)
class Window:
    """A measured span of the wall time: ``kind`` (a key of ``PRIORITY``); ``phase`` names
    the recovery phase of a ``recovery`` window."""

    kind: str
    start: float
    end: float
    phase: str = ""


@dataclass(frozen=True)
class Goodput:
    """Seconds per part of the wall time; ``recovery_s`` per phase, summed over recoveries.
    ``snapshot_stall_reported`` is False when no rank published its stall (then 0)."""

    wall_s: float
    startup_s: float = 0.0
    productive_s: float = 0.0
    redone_s: float = 0.0
    snapshot_stall_s: float = 0.0
    recovery_s: Mapping[str, float] = field(default_factory=dict)
    waiting_for_capacity_s: float = 0.0
    shutdown_s: float = 0.0
    snapshot_stall_reported: bool = False
    recoveries: int = 0
    lost_steps: int = 0
    steps_computed: int = 0
    mean_step_s: float = 0.0

    @property
    def effective(self) -> float:
        """productive / wall (0 for an empty run)."""
        return self.productive_s / self.wall_s if self.wall_s > 0 else 0.0

    def parts(self) -> dict[str, float]:
        """Every part, flat (recovery phases as ``recovery.<phase>``); they sum to wall."""
        return {"startup": self.startup_s, "productive": self.productive_s,
                "redone": self.redone_s, "snapshot_stall": self.snapshot_stall_s,
                **{f"recovery.{p}": s for p, s in self.recovery_s.items()},
                "waiting_for_capacity": self.waiting_for_capacity_s, "shutdown": self.shutdown_s}

    def widened(self, before_s: float, after_s: float) -> "Goodput":
        """The same run seen over a longer wall window: ``before_s`` more start-up (e.g. the
        process starting) and ``after_s`` more shutdown (e.g. its teardown)."""
        before_s, after_s = max(0.0, before_s), max(0.0, after_s)
        return replace(self, wall_s=self.wall_s + before_s + after_s,
                       startup_s=self.startup_s + before_s, shutdown_s=self.shutdown_s + after_s)

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> "Goodput":
        """The inverse of ``to_json`` (rounded as it was written)."""
        return cls(
            wall_s=float(doc["wall_s"]), startup_s=float(doc.get("startup_s", 0.0)),
            productive_s=float(doc.get("productive_s", 0.0)),
            redone_s=float(doc.get("redone_s", 0.0)),
            snapshot_stall_s=float(doc.get("snapshot_stall_s", 0.0)),
            recovery_s={str(p): float(s) for p, s in (doc.get("recovery_s") or {}).items()},
            waiting_for_capacity_s=float(doc.get("waiting_for_capacity_s", 0.0)),
            shutdown_s=float(doc.get("shutdown_s", 0.0)),
            snapshot_stall_reported=bool(doc.get("snapshot_stall_reported", False)),
            recoveries=int(doc.get("recoveries", 0)), lost_steps=int(doc.get("lost_steps", 0)),
            steps_computed=int(doc.get("steps_computed", 0)),
            mean_step_s=float(doc.get("mean_step_s", 0.0)))

    def to_json(self) -> dict[str, Any]:
        parts = self.parts()
        return {"wall_s": round(self.wall_s, ROUND), "effective": round(self.effective, ROUND),
                "startup_s": round(self.startup_s, ROUND),
                "productive_s": round(self.productive_s, ROUND),
                "redone_s": round(self.redone_s, ROUND),
                "snapshot_stall_s": round(self.snapshot_stall_s, ROUND),
                "recovery_s": {p: round(s, ROUND) for p, s in self.recovery_s.items()},
                "waiting_for_capacity_s": round(self.waiting_for_capacity_s, ROUND),
                "shutdown_s": round(self.shutdown_s, ROUND),
                "sum_s": round(sum(parts.values()), ROUND),
                "snapshot_stall_reported": self.snapshot_stall_reported,
                "recoveries": self.recoveries, "lost_steps": self.lost_steps,
                "steps_computed": self.steps_computed,
                "mean_step_s": round(self.mean_step_s, 6), "redone_from": REDONE_FROM}


def account(start: float, end: float, windows: Iterable[Window], *, steps_computed: int,
            lost_steps: int = 0, snapshot_stall_s: float | None = None,
            recoveries: int = 0) -> Goodput:
    """Divide [start, end) among ``windows`` (clipped to it; overlaps go to the higher
    priority, see the module docstring) and training time, then training time into stall,
    redone and productive. O(w log w) in the number of windows."""
    end = max(start, end)
    totals: dict[tuple[str, str], float] = {}
    for (kind, phase), seconds in _partition(start, end, windows):
        totals[(kind, phase)] = totals.get((kind, phase), 0.0) + seconds
    training = sum(s for (kind, _), s in totals.items() if kind == "training")
    stall = min(max(0.0, snapshot_stall_s or 0.0), training)
    net = training - stall
    steps = max(0, steps_computed)
    mean_step = net / steps if steps else 0.0
    redone = min(net, max(0, lost_steps) * mean_step)
    phases: dict[str, float] = {}
    for (kind, phase), seconds in totals.items():
        if kind == "recovery":
            phases[phase] = phases.get(phase, 0.0) + seconds
    return Goodput(
        wall_s=end - start, startup_s=totals.get(("startup", ""), 0.0),
        productive_s=net - redone, redone_s=redone, snapshot_stall_s=stall,
        recovery_s=phases, waiting_for_capacity_s=totals.get(("waiting_for_capacity", ""), 0.0),
        shutdown_s=totals.get(("shutdown", ""), 0.0),
        snapshot_stall_reported=snapshot_stall_s is not None, recoveries=recoveries,
        lost_steps=max(0, lost_steps), steps_computed=steps, mean_step_s=mean_step)


def _partition(start: float, end: float,
               windows: Iterable[Window]) -> Iterable[tuple[tuple[str, str], float]]:
    """(label, seconds) for each piece between consecutive boundaries: a sweep over the
    window edges with a heap of the windows open at each piece (lazy deletion)."""
    clipped = sorted((max(start, w.start), min(end, w.end), i, w)
                     for i, w in enumerate(windows) if min(end, w.end) > max(start, w.start))
    cuts = sorted({start, end, *(c[0] for c in clipped), *(c[1] for c in clipped)})
    open_: list[tuple[int, int, float, Window]] = []
    nxt = 0
    for left, right in zip(cuts, cuts[1:]):
        while nxt < len(clipped) and clipped[nxt][0] <= left:
            w_start, w_end, i, w = clipped[nxt]
            heapq.heappush(open_, (PRIORITY[w.kind], i, w_end, w))
            nxt += 1
        while open_ and open_[0][2] <= left:
            heapq.heappop(open_)
        label = ("training", "") if not open_ else (open_[0][3].kind, open_[0][3].phase)
        yield label, right - left


def goodput_from_events(events: Sequence[Event], started_at: float, ended_at: float, *,
                        trained_until: float | None = None,
                        final_step: int | None = None) -> Goodput:
    """The breakdown of a run from its events. ``started_at``/``ended_at``: the launch's
    wall clock; ``trained_until``: when training ended (the first rank's entrypoint
    returned), else the job's failure, else the last progress sample of a finished run,
    else ``ended_at`` (a live run); ``final_step``: the step the ranks ended at, else the
    last progress sample's. Missing or unknown fields are tolerated, never raised on."""
    ordered = sorted((e for e in events if "event" in e), key=_time)
    progress = [e for e in ordered if e["event"] == "progress"]
    recovered = [e for e in ordered if e["event"] == "recovered"]
    first = next((e for e in ordered if e["event"] == "first_step"), None) or next(
        (e for e in progress if _int(e.get("min_step")) >= 1), None)
    end_of_training = _training_end(ordered, progress, ended_at, trained_until)
    windows = [Window("startup", started_at, _time(first) if first else end_of_training),
               Window("shutdown", end_of_training, ended_at)]
    windows += _phase_windows(ordered, ended_at)
    for record in recovered:
        windows += _recovered_windows(record, ordered)
    final = final_step if final_step is not None else max(
        (_int(e.get("max_step")) for e in progress), default=0)
    first_step = (_int(first.get("step", first.get("min_step"))) if first else 0)
    lost = sum(_int(r.get("lost_steps")) for r in recovered)
    stalls = [e["snapshot_stall_s"] for e in progress
              if isinstance(e.get("snapshot_stall_s"), (int, float))]
    return account(started_at, ended_at, windows,
                   steps_computed=max(0, final - first_step + lost - len(recovered)),
                   lost_steps=lost, snapshot_stall_s=float(stalls[-1]) if stalls else None,
                   recoveries=len(recovered))


def _training_end(ordered: Sequence[Event], progress: Sequence[Event], ended_at: float,
                  trained_until: float | None) -> float:
    if trained_until is not None:
        return min(trained_until, ended_at)
    failed = [_time(e) for e in ordered if e["event"] == "job_failed"
              or (e["event"] == "phase" and e.get("to") == "failed")]
    if failed:
        return min(failed)
    if any(e["event"] == "finished" for e in ordered) and progress:
        return _time(progress[-1])
    return ended_at


def _phase_windows(ordered: Sequence[Event], ended_at: float) -> list[Window]:
    """One window per visit of a non-steady coordinator phase, from its ``phase`` events."""
    windows: list[Window] = []
    current, entered = "steady", 0.0
    for event in ordered:
        if event["event"] != "phase":
            continue
        windows += _phase_window(current, entered, _time(event))
        current, entered = str(event.get("to", "steady")), _time(event)
    return windows + _phase_window(current, entered, ended_at)


def _phase_window(phase: str, start: float, end: float) -> list[Window]:
    if phase in NOT_RECOVERY or end <= start:
        return []
    if phase == WAITING_PHASE:
        return [Window("waiting_for_capacity", start, end)]
    return [Window("recovery", start, end, phase)]


def _recovered_windows(record: Event, ordered: Sequence[Event]) -> list[Window]:
    """From a ``recovered`` record: ``detect`` (fault observed -> coordinator in DETECTING,
    the record's own ``phases_s.detect``) and the ranks' stepping between the first step of
    the new generation and the coordinator seeing it (training, not recovery)."""
    at = _time(record)
    first = record.get("first_step_at")
    windows = []
    if isinstance(first, (int, float)):
        fault = float(first) - float(record.get("fault_to_first_step_s") or 0.0)
        detect = float((record.get("phases_s") or {}).get("detect") or 0.0)
        windows.append(Window("recovery", fault, fault + detect, "detect"))
        restoring = [_time(e) for e in ordered if e["event"] == "phase"
                     and e.get("to") == "restoring" and _time(e) <= at]
        stepping = max(float(first), restoring[-1] if restoring else float(first))
        windows.append(Window("training", stepping, at))
    return windows


def summary_line(goodput: Mapping[str, Any]) -> str:
    """One line from ``Goodput.to_json()``: effective share, then the parts over 0."""
    recovery = _in_order(goodput.get("recovery_s") or {})
    phases = ", ".join(f"{p} {s:.2f}" for p, s in recovery.items() if s >= 0.005)
    parts = [("productive", goodput.get("productive_s", 0.0)),
             ("startup", goodput.get("startup_s", 0.0)),
             ("recovery", sum(recovery.values())),
             ("redone", goodput.get("redone_s", 0.0)),
             ("snapshot stall", goodput.get("snapshot_stall_s", 0.0)),
             ("waiting for capacity", goodput.get("waiting_for_capacity_s", 0.0)),
             ("shutdown", goodput.get("shutdown_s", 0.0))]
    text = ", ".join(f"{name} {s:.2f} s" + (f" ({phases})" if name == "recovery" and phases
                                             else "")
                     for name, s in parts if s >= 0.005 or name == "productive")
    stall = "" if goodput.get("snapshot_stall_reported", True) else "; snapshot stall not reported"
    return (f"goodput {goodput.get('effective', 0.0) * 100:.1f}% of "
            f"{goodput.get('wall_s', 0.0):.2f} s wall: {text}{stall}")


def markdown_breakdown(goodput: Mapping[str, Any]) -> list[str]:
    """Markdown lines from ``Goodput.to_json()``: the effective share, then a table with
    one row per part and their sum."""
    rows = [("startup", goodput.get("startup_s")), ("productive", goodput.get("productive_s")),
            ("redone", goodput.get("redone_s")),
            ("snapshot stall", goodput.get("snapshot_stall_s")),
            *((f"recovery: {p}", s) for p, s in _in_order(goodput.get("recovery_s") or {}).items()),
            ("waiting for capacity", goodput.get("waiting_for_capacity_s")),
            ("shutdown", goodput.get("shutdown_s"))]
    wall = float(goodput.get("wall_s") or 0.0)
    stall = "" if goodput.get("snapshot_stall_reported", True) else " Snapshot stall not reported."
    lines = [f"Effective training time {float(goodput.get('effective') or 0.0) * 100:.1f}% of "
             f"{wall:.2f} s wall; redone = {goodput.get('redone_from', REDONE_FROM)}.{stall}", "",
             "| part | s | share |", "|---|---|---|"]
    lines += [f"| {name} | {float(s or 0.0):.3f} | "
              f"{(float(s or 0.0) / wall * 100 if wall else 0.0):.1f}% |" for name, s in rows]
    return lines + [f"| **sum** | {float(goodput.get('sum_s') or 0.0):.3f} | |", ""]


def _in_order(phases: Mapping[str, float]) -> dict[str, float]:
    rank = {p: i for i, p in enumerate(PHASE_ORDER)}
    return dict(sorted(phases.items(), key=lambda kv: (rank.get(kv[0], len(rank)), kv[0])))


def _time(event: Event) -> float:
    value = event.get("time", 0.0)
    return float(value) if isinstance(value, (int, float)) else 0.0


def _int(value: Any) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
