"""The drill report's timeline PNG: steps over seconds since start, one line per injected
fault, shaded recovery phases and the job's failure. matplotlib is imported lazily, so a
missing matplotlib only costs the picture (``render_png`` raises ``ImportError``)."""
from __future__ import annotations

import io
from typing import Any, Mapping

FIGSIZE, DPI = (10, 5), 110
PHASE_COLOURS = {"detect": "#f4a261", "detecting": "#e9c46a", "planning": "#8ab17d",
                 "fencing": "#2a9d8f", "promoting": "#457b9d", "restoring": "#9d4edd",
                 "resuming": "#bdb2ff"}
SPANNED = tuple(p for p in PHASE_COLOURS if p != "detect")   # consecutive after detection


def render_png(report: Mapping[str, Any]) -> bytes:
    """The timeline as PNG bytes. Raises ``ImportError`` when matplotlib is missing.
    Uses the Agg canvas directly (no pyplot), so no global backend state is touched."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    _plot_steps(axes, report.get("timeline") or [])
    for span in phase_spans(report.get("faults") or []):
        axes.axvspan(span[1], span[2], color=PHASE_COLOURS[span[0]], alpha=0.45,
                     label=span[0], linewidth=0)
    _plot_faults(axes, report.get("faults") or [])
    failed = (report.get("run") or {}).get("job_failed")
    if failed:
        axes.axvline(failed["at_s"], color="#d62828", linewidth=2.0, label="job failed")
        axes.text(failed["at_s"], 0.5, f" job failed: {failed['error_type']}",
                  transform=axes.get_xaxis_transform(), color="#d62828", fontsize=8)
    verdict = "PASS" if report.get("passed") else "FAIL"
    axes.set_title(f"drill {report['scenario']['name']}: {verdict}",
                   color="#2a9d8f" if verdict == "PASS" else "#d62828")
    axes.set_xlabel("seconds since start")
    axes.set_ylabel("step")
    axes.grid(alpha=0.3)
    _legend(axes)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return buffer.getvalue()


def phase_spans(faults: list[Mapping[str, Any]]) -> list[tuple[str, float, float]]:
    """(phase, start_s, end_s) spans, from each fault's injection: ``detect`` until phalanx
    detected it, then the recovery's phases back to back. A recovery shared by several
    faults is drawn once, from the first of them."""
    spans: list[tuple[str, float, float]] = []
    drawn: set[Any] = set()
    for fault in faults:
        if fault.get("detection_s") is None:
            continue
        start = float(fault["at_s"])
        cursor = start + float(fault["detection_s"])
        recovery = fault.get("recovery")
        if recovery is not None and recovery.get("generation") in drawn:
            continue
        spans.append(("detect", start, cursor))
        if recovery is None:
            continue
        drawn.add(recovery.get("generation"))
        for phase in SPANNED:
            seconds = (recovery.get("phases_s") or {}).get(phase)
            if seconds:
                spans.append((phase, cursor, cursor + float(seconds)))
                cursor += float(seconds)
    return spans


def _plot_steps(axes: Any, timeline: list[list[Any]]) -> None:
    if not timeline:
        axes.text(0.5, 0.5, "no progress events in this run", transform=axes.transAxes,
                  ha="center", color="grey")
        return
    seconds = [row[0] for row in timeline]
    axes.plot(seconds, [row[2] for row in timeline], drawstyle="steps-post",
              color="#264653", label="max step")
    axes.plot(seconds, [row[1] for row in timeline], drawstyle="steps-post",
              color="#e76f51", linestyle="--", label="min step")


def _plot_faults(axes: Any, faults: list[Mapping[str, Any]]) -> None:
    for fault in faults:
        axes.axvline(fault["at_s"], color="black", linewidth=1.0, linestyle=":")
        axes.text(fault["at_s"], 0.98, f" #{fault['index']} {fault['kind']} {fault['target']}",
                  transform=axes.get_xaxis_transform(), rotation=90, va="top", fontsize=8)
        recovery = fault.get("recovery")
        if recovery and recovery.get("recovery_s") is not None:
            first = fault["at_s"] + recovery["recovery_s"]
            axes.axvline(first, color="#2a9d8f", linewidth=1.0, linestyle="-.",
                         label="first step of new generation")


def _legend(axes: Any) -> None:
    """One legend entry per label (phases repeat per recovery)."""
    handles, labels = axes.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    if unique:
        axes.legend(unique.values(), unique.keys(), loc="lower right", fontsize=7, ncol=2)
