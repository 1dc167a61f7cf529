"""The drill report: a drilled run's events turned into what each injected fault caused
(detection, recovery phases, restore sources, lost steps, spares), one PASS/FAIL row per
expectation, and the files ``drill-report.json``/``.md``/``.png`` in the run directory."""
from __future__ import annotations

import json
import logging
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from phalanx.runtime.base import node_name
from phalanx.launcher.drills.catalogue import REGISTRY, FaultSpec
from phalanx.launcher.goodput import goodput_from_events, markdown_breakdown, summary_line
from phalanx.runtime.tiers.disk import atomic_write

if TYPE_CHECKING:
    from phalanx.launcher.drills.scenario import Scenario

log = logging.getLogger(__name__)
JSON_NAME, MD_NAME, PNG_NAME = "drill-report.json", "drill-report.md", "drill-report.png"
NEEDS_RECOVERY = ("replace", "rollback")     # Mechanism.recovers values that start a generation
PHASES = ("detect", "detecting", "planning", "fencing", "promoting", "restoring", "resuming")
_FAULT_FIELDS = {"event", "time", "index", "kind", "target", "trigger", "step", "details"}
_RANK_TARGET = re.compile(r"^rank (\d+)$")
Event = Mapping[str, Any]


@dataclass(frozen=True)
class RunOutcome:
    """One ``phalanx launch`` subprocess, as parsed by the drill runner."""

    returncode: int
    hashes: dict[int, str]          # rank -> final parameter sha256 hex (empty if the run failed)
    run_dir: Path | None
    error: str = ""                 # the launcher's failure line, e.g. "job failed: ..."
    seconds: float = 0.0


def build_report(scenario: "Scenario", drilled: RunOutcome, reference: Mapping[int, str] | None,
                 reference_source: str, events: Sequence[Event],
                 summary: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Pure: the report of one drilled run (JSON-able). Missing or unknown event fields
    (older runs lack ``progress``, ``rank_restored``, ...) are tolerated, never raised on.
    ``summary``: the run's summary.json (its goodput), if it wrote one."""
    ordered = sorted((e for e in events if "event" in e), key=_time)
    t0 = next((_time(e) for e in ordered if e["event"] == "started"),
              _time(ordered[0]) if ordered else 0.0)
    ref = None if reference is None else {int(r): str(h) for r, h in reference.items()}
    faults = _fault_reports(scenario.faults, ordered, t0)
    report: dict[str, Any] = {
        "scenario": {"name": scenario.name, "description": scenario.description,
                     "expect": dict(scenario.expect)},
        "run": _run_header(drilled, ordered, t0),
        "reference": {"source": reference_source if ref is not None else "none (no reference run)",
                      "available": ref is not None},
        "final_state": _hash_rows(drilled.hashes, ref),
        "faults": faults,
        "recoveries": [_recovery_summary(r, t0) for r in _named(ordered, "recovered")],
        "timeline": [[round(_time(e) - t0, 3), e.get("min_step"), e.get("max_step")]
                     for e in _named(ordered, "progress")],
        "event_counts": dict(Counter(str(e["event"]) for e in ordered)),
        "goodput": _goodput(summary, ordered, t0),
    }
    report["checks"] = check_expectations(scenario, drilled, ref, ordered, faults)
    report["passed"] = all(row["ok"] for row in report["checks"])
    return report


def write_report(report: Mapping[str, Any], run_dir: Path) -> list[Path]:
    """Write the JSON, Markdown and (when matplotlib imports) PNG report into ``run_dir``,
    each atomically; returns the paths written. Raises ``OSError`` if ``run_dir`` cannot
    be written. Without matplotlib the report records ``png: null`` and the reason."""
    full = dict(report)
    png: bytes | None = None
    try:
        from phalanx.launcher.drills.plot import render_png
        png = render_png(full)
        full["png"], full["png_missing"] = PNG_NAME, None
    except ImportError as exc:      # matplotlib is optional: the report stands without it
        full["png"], full["png_missing"] = None, f"matplotlib is not importable ({exc})"
        log.warning("drill_report png=skipped reason=%r", full["png_missing"])
    written = [run_dir / JSON_NAME, run_dir / MD_NAME]
    atomic_write(written[0], memoryview(json.dumps(full, indent=2, default=str).encode()))
    atomic_write(written[1], memoryview(render_markdown(full).encode()))
    if png is not None:
        written.append(run_dir / PNG_NAME)
        atomic_write(written[2], memoryview(png))
    log.info("drill_report written=%s passed=%s", run_dir, full.get("passed"))
    return written


def _goodput(summary: Mapping[str, Any] | None, events: Sequence[Event],
             t0: float) -> dict[str, Any] | None:
    """The run's goodput: its summary.json's, else computed from the events over the
    window ``started`` event .. last event (a run that wrote no summary)."""
    if summary is not None and isinstance(summary.get("goodput"), Mapping):
        return {"source": "summary.json", **summary["goodput"]}
    if not events:
        return None
    return {"source": "events.jsonl (started event to last event)",
            **goodput_from_events(events, t0, _time(events[-1])).to_json()}


def _goodput_section(goodput: Mapping[str, Any] | None) -> list[str]:
    if not goodput:
        return []
    return ["## Goodput", "", f"From {goodput.get('source')}.", "", *markdown_breakdown(goodput)]


def goodput_text(report: Mapping[str, Any]) -> str:
    """The report's goodput as one line (``summary_line``), or why there is none."""
    goodput = report.get("goodput")
    return summary_line(goodput) if goodput else "goodput: not measured (no events)"


def console_rows(report: Mapping[str, Any]) -> list[tuple[str, str, str, str]]:
    """(check, expected, measured, PASS/FAIL) per check, for a rich table."""
    return [(str(r["check"]), str(r["expected"]), str(r["measured"]),
             "PASS" if r["ok"] else "FAIL") for r in report.get("checks", ())]


# ---- what each fault caused ----------------------------------------------------------------

def _fault_reports(specs: Sequence[FaultSpec], events: Sequence[Event],
                   t0: float) -> list[dict[str, Any]]:
    """Match each ``drill_fault`` with the first detection in its window (until the next
    fault injected at another step) and the recovery that followed that detection; faults
    injected at the same step share a window and so may share one recovery."""
    fired = _named(events, "drill_fault")
    detections, recoveries = _named(events, "fault"), _named(events, "recovered")
    ends = {e.get("index"): _time(e) for e in _named(events, "drill_fault_end")}
    reports = []
    for position, fault in enumerate(fired):
        start = _time(fault)
        end = next((_time(f) for f in fired[position + 1:] if f.get("step") != fault.get("step")
                    or fault.get("step") is None), math.inf)
        rank = _target_rank(fault)
        window = [d for d in detections if start <= _time(d) < end]
        detection = next((d for d in window if rank in d.get("ranks", ())),
                         window[0] if window else None)
        if detection is not None:
            recovery = _first_overlapping(recoveries, _time(detection), detection.get("ranks", ()))
        else:
            recovery = next((r for r in recoveries if start <= _time(r) < end), None)
        entry = _fault_entry(specs, fault, position, t0)
        entry.update(_reaction(fault, detection, recovery, events, t0))
        index = entry["index"]
        entry["ended_at_s"] = round(ends[index] - t0, 3) if index in ends else None
        reports.append(entry)
    return reports


def _fault_entry(specs: Sequence[FaultSpec], fault: Event, position: int,
                 t0: float) -> dict[str, Any]:
    index = fault.get("index", position)
    spec = specs[index] if isinstance(index, int) and 0 <= index < len(specs) else None
    details = fault.get("details")
    if not isinstance(details, Mapping):   # older runs put the details beside the fields
        details = {k: v for k, v in fault.items() if k not in _FAULT_FIELDS}
    target = fault.get("target") or (spec.target_text() if spec else _old_target(fault))
    trigger = fault.get("trigger") or (spec.trigger_text() if spec else "")
    return {"index": index, "kind": fault.get("kind", "?"), "target": target,
            "trigger": trigger, "step": fault.get("step"), "at_s": round(_time(fault) - t0, 3),
            "details": dict(details)}


def _reaction(fault: Event, detection: Event | None, recovery: Event | None,
              events: Sequence[Event], t0: float) -> dict[str, Any]:
    start = _time(fault)
    mech = REGISTRY.get(str(fault.get("kind")))
    needs = mech.recovers in NEEDS_RECOVERY if mech else detection is not None
    out: dict[str, Any] = {
        "detected": None if detection is None else {
            "kind": detection.get("kind"), "ranks": list(detection.get("ranks", ())),
            "node": detection.get("node"), "evidence": detection.get("evidence", ""),
            "at_s": round(_time(detection) - t0, 3)},
        "detection_s": None if detection is None else round(_time(detection) - start, 3),
        "needs_recovery": needs or recovery is not None,
        "recovery": None if recovery is None else _recovery_detail(recovery, events, start),
        "no_recovery": ""}
    out["recovery_s"] = out["recovery"]["recovery_s"] if recovery is not None else None
    if recovery is None:
        out["no_recovery"] = _no_recovery_text(detection, needs, events)
    return out


def _recovery_detail(recovery: Event, events: Sequence[Event], start: float) -> dict[str, Any]:
    generation = recovery.get("generation")
    same = [e for e in events if e.get("generation") == generation]
    restores = [_restore_row(e) for e in same if e["event"] == "rank_restored"]
    promotions = [{"rank": e.get("rank"), "worker": e.get("worker"), "node": e.get("node"),
                   "spare": str(e.get("worker", "")).startswith("spare"),
                   "warming": bool(e.get("warming"))}
                  for e in same if e["event"] == "promoted"]
    plan = next((e for e in same if e["event"] == "plan"), {})
    first, phases = recovery.get("first_step_at"), dict(recovery.get("phases_s") or {})
    up = recovery.get("workers_up_at")
    return {"generation": generation, "restore_step": recovery.get("restore_step"),
            "fault": recovery.get("fault"), "ranks": list(recovery.get("ranks", ())),
            "phases_s": {p: phases[p] for p in sorted(phases, key=_phase_order)},
            "recovery_s": None if first is None else round(float(first) - start, 3),
            # injection -> every spare / fresh worker of the plan running: a fresh worker's
            # start-up (Python, torch) is most of a recovery without a warm spare
            "workers_up_s": None if up is None else round(float(up) - start, 3),
            "lost_steps": recovery.get("lost_steps"), "restores": restores,
            "bytes_moved": sum(int(r["bytes"] or 0) for r in restores),
            "spare_used": any(p["spare"] for p in promotions), "promotions": promotions,
            "actions": list(plan.get("actions", ())), "reason": recovery.get("reason", "")}


def _restore_row(event: Event) -> dict[str, Any]:
    size, seconds = event.get("bytes"), event.get("seconds")
    rate = size / seconds / 1e9 if size and seconds and seconds > 0 else None
    return {"rank": event.get("rank"), "step": event.get("step"), "source": event.get("source"),
            "source_kind": event.get("source_kind"), "bytes": size, "seconds": seconds,
            "gb_per_s": None if rate is None else round(rate, 3)}


def _no_recovery_text(detection: Event | None, needs: bool, events: Sequence[Event]) -> str:
    if detection is None:
        text = ("no recovery: nothing was detected" if needs else
                "no recovery: none needed (nothing was detected; the run only slowed or "
                "repaired a copy)")
    else:
        text = f"no recovery: {detection.get('kind')} was detected but no new generation followed"
    failed = next((e for e in events if e["event"] == "job_failed"), None)
    if failed is not None:
        text += f"; the job failed: {failed.get('error_type')}: {failed.get('message')}"
    return text


def _recovery_summary(recovery: Event, t0: float) -> dict[str, Any]:
    first = recovery.get("first_step_at")
    return {"generation": recovery.get("generation"), "fault": recovery.get("fault"),
            "at_s": round(_time(recovery) - t0, 3),
            "first_step_s": None if first is None else round(float(first) - t0, 3),
            "lost_steps": recovery.get("lost_steps"),
            "restore_step": recovery.get("restore_step")}


def _run_header(drilled: RunOutcome, events: Sequence[Event], t0: float) -> dict[str, Any]:
    started = next((e for e in events if e["event"] == "started"), None)
    failed = next((e for e in events if e["event"] == "job_failed"), None)
    finished = next((e for e in events if e["event"] == "finished"), None)
    return {"run_dir": None if drilled.run_dir is None else str(drilled.run_dir),
            "exit_code": drilled.returncode, "error": drilled.error,
            "seconds": round(drilled.seconds, 3),
            "started": None if started is None else {
                k: started.get(k) for k in ("world_size", "nodes", "spares")},
            "job_failed": None if failed is None else {
                "at_s": round(_time(failed) - t0, 3), "error_type": failed.get("error_type"),
                "message": failed.get("message")},
            "finished_at_s": None if finished is None else round(_time(finished) - t0, 3)}


def _hash_rows(hashes: Mapping[int, str], reference: Mapping[int, str] | None) -> list[dict]:
    rows = []
    for rank in sorted(set(hashes) | set(reference or {})):
        mine, theirs = hashes.get(rank), (reference or {}).get(rank)
        verdict = ("no reference" if reference is None else
                   "missing" if mine is None or theirs is None else
                   "identical" if mine == theirs else "DIFFERENT")
        rows.append({"rank": rank, "hash": mine, "reference": theirs, "verdict": verdict})
    return rows


# ---- expectations --------------------------------------------------------------------------

def check_expectations(scenario: "Scenario", drilled: RunOutcome,
                       reference: Mapping[int, str] | None, events: Sequence[Event],
                       faults: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row {check, expected, measured, ok, text} per expectation, always including
    "every fault fired" and "job outcome"."""
    expect = scenario.expect
    recovered = _named(events, "recovered")
    rows = [_fired_row(scenario.faults, faults), _outcome_row(expect, drilled)]
    if "max_recovery_s" in expect:
        rows.append(_recovery_time_row(float(expect["max_recovery_s"]), faults))
    if "max_after_workers_up_s" in expect:
        rows.append(_recovery_time_row(float(expect["max_after_workers_up_s"]), faults,
                                       after_workers_up=True))
    if "max_lost_steps" in expect:
        worst = max((int(r.get("lost_steps") or 0) for r in recovered), default=0)
        rows.append(_row("lost steps", f"<= {expect['max_lost_steps']}", worst,
                         worst <= int(expect["max_lost_steps"])))
    if expect.get("final_state", "any") != "any":
        rows.append(_final_state_row(str(expect["final_state"]), drilled.hashes, reference))
    if "recoveries" in expect:
        rows.append(_row("recoveries", expect["recoveries"], len(recovered),
                         len(recovered) == int(expect["recoveries"])))
    if "restore_source" in expect:
        seen = sorted({str(e.get("source_kind")) for e in _named(events, "rank_restored")})
        rows.append(_row("restore source", f"{expect['restore_source']} (at least once)",
                         ", ".join(seen) or "no rank_restored events",
                         expect["restore_source"] in seen))
    if "detected" in expect:
        kinds = sorted({str(e.get("kind")) for e in _named(events, "fault")})
        rows.append(_row("detected", expect["detected"], ", ".join(kinds) or "nothing",
                         expect["detected"] in kinds))
    for name in expect.get("events", []):
        after = _named(events, name)
        rows.append(_row(f"event {name}", ">= 1", len(after), bool(after)))
    return rows


def _row(check: str, expected: Any, measured: Any, ok: bool) -> dict[str, Any]:
    verdict = "PASS" if ok else "FAIL"
    return {"check": check, "expected": expected, "measured": measured, "ok": bool(ok),
            "text": f"{check}: expected {expected}, measured {measured} -> {verdict}"}


def _fired_row(specs: Sequence[FaultSpec], faults: Sequence[Mapping[str, Any]]) -> dict:
    # a fault whose injection raised (details.error) did not fire
    faults = [f for f in faults if not (f.get("details") or {}).get("error")]
    fixed = {s.index for s in specs if s.probability is None}
    if len(fixed) == len(specs):
        return _row("every fault fired", len(specs), len(faults), len(faults) == len(specs))
    expected = "probabilistic" if not fixed else f"{len(fixed)} + probabilistic"
    return _row("every fault fired", expected, len(faults),
                fixed <= {f["index"] for f in faults})


def _outcome_row(expect: Mapping[str, Any], drilled: RunOutcome) -> dict[str, Any]:
    outcome, wanted = expect.get("outcome", "completes"), expect.get("error_contains")
    code = f"exit {drilled.returncode}" + (f": {drilled.error}" if drilled.error else "")
    if outcome == "completes":
        return _row("job outcome", "exit 0", code, drilled.returncode == 0)
    if outcome == "fails":
        expected = "exit != 0" + (f", error contains {wanted!r}" if wanted else "")
        ok = drilled.returncode != 0 and (not wanted or str(wanted) in drilled.error)
        return _row("job outcome", expected, code, ok)
    return _row("job outcome", f"{outcome!r} (unknown: use completes or fails)", code, False)


def _recovery_time_row(limit: float, faults: Sequence[Mapping[str, Any]],
                       after_workers_up: bool = False) -> dict[str, Any]:
    """The worst fault's injection -> first step; ``after_workers_up``: from its plan's
    spares and fresh workers running (their process start-up, Python and torch imports,
    left out: what remains is phalanx's group, restore and redone step)."""
    check = "after new workers ran (s)" if after_workers_up else "recovery time (s)"
    needed = [f for f in faults if f["needs_recovery"]]
    times = [f["recovery_s"] for f in needed]
    if not needed:
        return _row(check, f"<= {limit:g}", "no recovery needed", True)
    if any(t is None for t in times):
        return _row(check, f"<= {limit:g}", "never", False)
    if after_workers_up:
        times = [round(f["recovery_s"] - (f["recovery"].get("workers_up_s") or 0.0), 3)
                 for f in needed]
    worst = max(times)
    return _row(check, f"<= {limit:g}", worst, worst <= limit)


def _final_state_row(wanted: str, hashes: Mapping[int, str],
                     reference: Mapping[int, str] | None) -> dict[str, Any]:
    check, expected = "final state", "bit-identical to the reference"
    if wanted != "identical":
        return _row(check, f"{wanted!r} (unknown: use identical or any)", "-", False)
    if reference is None:
        return _row(check, expected, "no reference", False)
    if not hashes:
        return _row(check, expected, "no final hashes (the run did not finish)", False)
    differ = sorted(r for r in set(hashes) | set(reference) if hashes.get(r) != reference.get(r))
    measured = "identical" if not differ else f"DIFFERENT (ranks {', '.join(map(str, differ))})"
    return _row(check, expected, measured, not differ)


# ---- Markdown ------------------------------------------------------------------------------

def render_markdown(report: Mapping[str, Any]) -> str:
    """The human rendering of the report: run header, final state, faults, checks."""
    run, scen = report["run"], report["scenario"]
    verdict = "PASS" if report["passed"] else "FAIL"
    lines = [f"# Drill `{scen['name']}`: {verdict}", "", scen["description"] or "", "",
             "| run | |", "|---|---|", f"| drilled run | `{run['run_dir']}` |",
             f"| exit code | {run['exit_code']} |", f"| error | {_cell(run['error'] or '-')} |",
             f"| wall time | {run['seconds']:.1f} s |",
             f"| goodput | {_cell(goodput_text(report))} |",
             f"| reference | {report['reference']['source']} |", ""]
    if run["job_failed"]:
        failed = run["job_failed"]
        lines += [f"**Job failed** at +{failed['at_s']} s: {failed['error_type']}: "
                  f"{failed['message']}", ""]
    lines += ["## Final state", "", "| rank | hash | reference | verdict |", "|---|---|---|---|"]
    lines += [f"| {h['rank']} | `{(h['hash'] or '-')[:16]}` | `{(h['reference'] or '-')[:16]}` "
              f"| {h['verdict']} |" for h in report["final_state"]]
    lines += ["", *_goodput_section(report.get("goodput")), "## Faults", ""]
    for fault in report["faults"]:
        lines += _markdown_fault(fault)
    lines += ["## Checks", "", "| check | expected | measured | result |", "|---|---|---|---|"]
    lines += [f"| {_cell(c)} | {_cell(e)} | {_cell(m)} | **{r}** |"
              for c, e, m, r in console_rows(report)]
    counts = ", ".join(f"{k} {v}" for k, v in sorted(report["event_counts"].items()))
    lines += ["", f"**Drill {verdict}**", "", f"Events: {counts or 'none'}", ""]
    if report.get("png"):
        lines += [f"![timeline]({report['png']})", ""]
    return "\n".join(lines)


def _markdown_fault(fault: Mapping[str, Any]) -> list[str]:
    details = ", ".join(f"{k}={v}" for k, v in fault["details"].items()) or "-"
    lines = [f"### Fault {fault['index']}: {fault['kind']} on {fault['target']} "
             f"({fault['trigger'] or 'trigger not recorded'})", "",
             f"- injected at step {fault['step']}, +{fault['at_s']} s after start; {details}"]
    detected = fault["detected"]
    lines.append("- detected: nothing" if detected is None else
                 f"- detected: {detected['kind']} of ranks {detected['ranks']} after "
                 f"{fault['detection_s']} s ({detected['evidence']})")
    rec = fault["recovery"]
    if rec is None:
        return lines + [f"- {fault['no_recovery']}", ""]
    phases = ", ".join(f"{k} {v:.3f} s" for k, v in rec["phases_s"].items()) or "not recorded"
    spares = ", ".join(f"rank {p['rank']} <- {p['worker']} on {p['node']} "
                       f"({_promoted_kind(p)})"
                       for p in rec["promotions"]) or "none"
    lines += [f"- recovery: generation {rec['generation']}, restore step {rec['restore_step']}, "
              f"{rec['recovery_s']} s from injection to first step, "
              f"lost steps {rec['lost_steps']}", f"- phases: {phases}",
              *([f"- new workers running {rec['workers_up_s']} s after injection"]
                if rec.get("workers_up_s") is not None else []),
              f"- promoted: {spares}", f"- restored: {rec['bytes_moved']} bytes moved", ""]
    if rec["restores"]:
        lines += ["| rank | source | kind | bytes | s | GB/s |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['rank']} | {r['source']} | {r['source_kind']} | {r['bytes']} | "
                  f"{r['seconds']} | {r['gb_per_s']} |" for r in rec["restores"]] + [""]
    return lines


def _promoted_kind(promotion: Mapping[str, Any]) -> str:
    if not promotion["spare"]:
        return "fresh worker"
    return "spare still warming up" if promotion.get("warming") else "warm spare"


def _cell(text: str) -> str:
    """A table cell: a '|' in an error message would split the row."""
    return str(text).replace("|", "\\|").replace("\n", " ")


# ---- event helpers -------------------------------------------------------------------------

def _time(event: Event) -> float:
    return float(event.get("time", 0.0))


def _named(events: Sequence[Event], name: str) -> list[Event]:
    return [e for e in events if e["event"] == name]


def _first_overlapping(recoveries: Sequence[Event], after: float,
                       ranks: Sequence[int]) -> Event | None:
    later = [r for r in recoveries if _time(r) >= after]
    return next((r for r in later if set(ranks) & set(r.get("ranks", ()))),
                later[0] if later else None)


def _phase_order(phase: str) -> tuple[int, str]:
    return (PHASES.index(phase) if phase in PHASES else len(PHASES), phase)


def _target_rank(fault: Event) -> int | None:
    match = _RANK_TARGET.match(str(fault.get("target", "")))
    return int(match.group(1)) if match else fault.get("rank")


def _old_target(fault: Event) -> str:
    if fault.get("rank") is not None:
        return f"rank {fault['rank']}"
    return node_name(fault['node']) if fault.get("node") is not None else "job"
