"""The run's summary, ``summary.json`` in the run directory: outcome, steps, recoveries,
wall time and goodput, written atomically when a run ends (finished or failed) and read by
``phalanx status`` and the reports; for a run whose launcher died without one,
``reconstruct`` rebuilds what the run directory's ``events.jsonl`` still tells."""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from phalanx.configs.errors import PhalanxError
from phalanx.launcher.goodput import goodput_from_events
from phalanx.runtime.base import FINISHED_PREFIX
from phalanx.runtime.tiers.disk import atomic_write

if TYPE_CHECKING:
    from phalanx.launcher.coordination.coordinator import RecoveryCoordinator

log = logging.getLogger(__name__)
SUMMARY_NAME = "summary.json"
EVENTS_NAME = "events.jsonl"
RECOVERY_FIELDS = ("generation", "fault", "ranks", "restore_step", "lost_steps",
                   "fault_to_first_step_s")
Event = Mapping[str, Any]


def build_summary(outcome: str, job: str, world_size: int, events: Sequence[Event],
                  started_at: float, ended_at: float, *, generation: int | None = None,
                  committed_step: int | None = None, final_step: int | None = None,
                  trained_until: float | None = None,
                  error: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Pure: the summary document. ``outcome``: finished | failed | dead. Without
    ``final_step`` or ``generation``, the last progress sample's are used."""
    ordered = sorted(events, key=lambda e: e["time"] if isinstance(e.get("time"), (int, float))
                     else 0.0)
    progress = [e for e in ordered if e.get("event") == "progress"]
    recovered = [e for e in ordered if e.get("event") == "recovered"]
    last = progress[-1] if progress else {}
    goodput = goodput_from_events(events, started_at, ended_at, trained_until=trained_until,
                                  final_step=final_step)
    return {"outcome": outcome, "job": job, "world_size": world_size,
            "steps": final_step if final_step is not None else int(last.get("min_step", 0)),
            "generation": generation if generation is not None else int(
                last.get("generation", 0)),
            "committed_step": -1 if committed_step is None else committed_step,
            "recoveries": len(recovered),
            "resumed_from": next(({k: v for k, v in e.items() if k not in ("event", "time")}
                                  for e in ordered if e.get("event") == "resumed_from"), None),
            "recovery_history": [{k: r.get(k) for k in RECOVERY_FIELDS} for r in recovered],
            "started_at": round(started_at, 3), "ended_at": round(ended_at, 3),
            "wall_s": round(ended_at - started_at, 3), "error": dict(error) if error else None,
            "goodput": goodput.to_json()}


def record_run_end(run_dir: Path, outcome: str, coordinator: "RecoveryCoordinator",
                   started: float, results: Mapping[int, Any] | None = None,
                   error: BaseException | None = None) -> dict[str, Any]:
    """Write ``summary.json`` for a run that ends now; the launcher's main thread calls it
    once (``started``: its ``time.monotonic()`` at launch). Returns the summary; never
    raises for an unwritable run directory (logged: the run's own outcome matters more)."""
    ended_at = time.time()
    info = _job_info(run_dir)
    started_at = float(info.get("started_at") or ended_at - (time.monotonic() - started))
    cfg = coordinator.cfg
    ends = [float(v["finished_at"]) for v in (results or {}).values()
            if isinstance(v, dict) and isinstance(v.get("finished_at"), (int, float))]
    summary = build_summary(
        outcome, cfg.job.name, cfg.job.world_size, read_run_events(run_dir),
        started_at, ended_at, generation=coordinator.generation,
        committed_step=coordinator.committed(),
        final_step=_final_step(coordinator) if outcome == "finished" else None,
        trained_until=min(ends) if ends else None,
        error=None if error is None else {"type": type(error).__name__,
                                          "message": str(error)[:2000]})
    try:
        write_summary(run_dir, summary)
    except OSError as exc:
        log.warning("event=summary_not_written run_dir=%s error=%s", run_dir, exc)
    return summary


def record_startup_lost(run_dir: Path, job: str, world_size: int, started_at: float,
                        error: BaseException) -> None:
    """``summary.json`` of a launch attempt that Ray lost before its coordinator existed
    (the launcher starts the job once more in a new run directory): without it the
    attempt's directory read as a run whose launcher died. Never raises (logged)."""
    summary = build_summary("failed", job, world_size, read_run_events(run_dir), started_at,
                            time.time(), error={"type": type(error).__name__,
                                                "message": str(error)[:2000]})
    try:
        write_summary(run_dir, summary)
    except OSError as exc:
        log.warning("event=summary_not_written run_dir=%s error=%s", run_dir, exc)


def _final_step(coordinator: "RecoveryCoordinator") -> int | None:
    """The step the ranks ended at: what each finished worker left under ``finished/``."""
    try:
        steps = [int(kv.value) for kv in coordinator.membership.list_prefix(FINISHED_PREFIX)]
    except (PhalanxError, ValueError) as exc:
        log.warning("event=final_step_unknown error=%s", exc)
        return None
    return min(steps) if steps else None


def write_summary(run_dir: Path, summary: Mapping[str, Any]) -> Path:
    """Atomically (temp file, fsync, rename); raises OSError."""
    path = run_dir / SUMMARY_NAME
    atomic_write(path, memoryview(json.dumps(summary, indent=2, sort_keys=True).encode()))
    return path


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    """The run's summary.json, or None when absent or unreadable."""
    try:
        value = json.loads((run_dir / SUMMARY_NAME).read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def reconstruct(run_dir: Path, outcome: str = "dead") -> dict[str, Any]:
    """What a run without summary.json (its launcher killed) still tells: the summary
    rebuilt from ``events.jsonl``, ending at its last event; ``reconstructed: true``."""
    info = _job_info(run_dir)
    events = read_run_events(run_dir)
    times = [float(e["time"]) for e in events if isinstance(e.get("time"), (int, float))]
    started_at = float(info.get("started_at") or _created(run_dir, times))
    ended_at = max([started_at, *times])
    failed = next((e for e in events if e.get("event") == "job_failed"), None)
    summary = build_summary(
        outcome, str(info.get("job", run_dir.name)), int(info.get("world_size", 0)), events,
        started_at, ended_at,
        error=None if failed is None else {"type": str(failed.get("error_type")),
                                           "message": str(failed.get("message"))})
    summary["reconstructed"] = True
    return summary


def _job_info(run_dir: Path) -> dict[str, Any]:
    try:
        info = json.loads((run_dir / "job.json").read_text())
    except (OSError, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


def _created(run_dir: Path, times: Sequence[float]) -> float:
    """When the run started, for a job.json without ``started_at``: config.yaml's mtime."""
    try:
        return (run_dir / "config.yaml").stat().st_mtime
    except OSError:
        return min(times, default=time.time())


def read_run_events(run_dir: Path) -> list[dict[str, Any]]:
    """Every whole JSON object line of the run's events.jsonl (a line being written, or
    torn by a killed launcher, is skipped); [] without one."""
    try:
        lines = (run_dir / EVENTS_NAME).read_text(errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict):
            events.append(event)
    return events
