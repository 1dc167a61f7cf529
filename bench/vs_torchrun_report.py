"""The report of ``bench/vs_torchrun.py``: medians per job and system (start-up apart from
the steady state), ratios phalanx/peer, targets, recovery vs world size, a markdown summary
and a PNG."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common import markdown_table, progress, verdict
from bench.recovery import med

METRICS = ("wall_s", "startup_s", "warmup_step_s", "steady_step_s", "window_step_s",
           "kill_to_first_step_s", "kill_to_regained_s", "lost_steps", "degraded_steps",
           "bytes_written", "peak_host_memory_bytes")
OVERHEADS = {"overhead": "steady_step_s", "window_overhead": "window_step_s",
             "warmup_overhead": "warmup_step_s"}   # each vs torchrun's same figure
SCALING_SYSTEMS = ("dcp_k10", "phalanx")


def summarize(runs: list[dict[str, Any]], labels: dict[str, str],
              references: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Per job and system (world 2 runs): medians of every metric over the ok runs,
    whether every ok run ended with the fault-free parameters (and torchft's reason when
    not), and the warm-up, steady-state and capture-window overheads vs ``torchrun``
    without checkpoints."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    ok_runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        if run["purpose"] != "main":
            continue
        cell = out.setdefault(run["job"], {}).setdefault(run["system"], {
            "label": labels[run["system"]], "runs": 0, "ok_runs": 0})
        cell["runs"] += 1
        if run.get("ok"):
            cell["ok_runs"] += 1
            ok_runs.setdefault((run["job"], run["system"]), []).append(run)
    for job, cells in out.items():
        for key, cell in cells.items():
            ok = ok_runs.get((job, key), [])
            for metric in METRICS:
                cell[metric] = med([r.get(metric) for r in ok])
            ref = references.get(job)
            cell["identical_to_fault_free"] = (all(r.get("hash") == ref for r in ok)
                                               if ok and ref else None)
            cell["differs_because"] = next((r["differs_because"] for r in ok
                                            if r.get("differs_because")), None)
            cell["goodput"] = _median_goodput(ok)
            cell["peak_memory_parts"] = _median_parts(ok, cell["peak_host_memory_bytes"])
            cell["effective"] = cell["goodput"]["effective"] if cell["goodput"] else None
        for name, metric in OVERHEADS.items():
            baseline = cells.get("torchrun", {}).get(metric)
            for cell in cells.values():
                step = cell.get(metric)
                cell[name] = (round(step / baseline - 1, 4)
                              if step is not None and baseline else None)
    return out


def _median_parts(runs: list[dict[str, Any]], peak: float | None) -> dict[str, int] | None:
    """Where the peak host memory went (``run_watch.part_of``), in the run whose peak is
    nearest the median: what each part of a system costs a user."""
    runs = [r for r in runs if r.get("peak_memory_parts") and r.get("peak_host_memory_bytes")]
    if not runs or peak is None:
        return None
    return min(runs, key=lambda r: abs(r["peak_host_memory_bytes"] - peak))["peak_memory_parts"]


def _median_goodput(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The goodput breakdown of the run with the median effective share (a breakdown of
    medians would not sum to a wall time)."""
    found = sorted((r["goodput"] for r in runs if r.get("goodput")), key=lambda g: g["effective"])
    return found[(len(found) - 1) // 2] if found else None


def ratios_of(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """phalanx / peer (every system but torchrun) for every metric."""
    out: dict[str, dict[str, Any]] = {}
    for job, cells in summary.items():
        mine = cells.get("phalanx")
        if mine is None:     # --systems without phalanx: nothing to compare
            continue
        for key, cell in cells.items():
            if key in ("phalanx", "torchrun"):
                continue
            out.setdefault(job, {})[key] = {
                metric: _ratio(mine.get(metric), cell.get(metric)) for metric in METRICS}
    return out


def _ratio(a: Any, b: Any) -> float | None:
    if a is None or b is None or not b:
        return None
    return round(a / b, 4)


def targets_of(summary: dict[str, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    found = []
    for job, cells in summary.items():
        mine = cells.get("phalanx")
        if mine is None:
            continue
        found += _issue_targets(job, mine, cells.get("torchrun"), cells.get("torchft"))
        k50, async10 = cells.get("dcp_k50"), cells.get("dcp_async_k10")
        if k50 is not None:
            speedup = _ratio(k50.get("kill_to_first_step_s"), mine.get("kill_to_first_step_s"))
            found.append({"job": job, "target": "recovery >= 10x faster than DCP k=50",
                          "measured": speedup,
                          "verdict": verdict(speedup is not None and speedup >= 10)})
        lost = mine.get("lost_steps")
        found.append({"job": job, "target": "phalanx lost steps <= 1", "measured": lost,
                      "verdict": verdict(lost is not None and lost <= 1)})
        if async10 is not None:
            a, b = mine.get("overhead"), async10.get("overhead")
            found.append({"job": job, "target": "phalanx overhead <= DCP async_save k=10",
                          "measured": {"phalanx": a, "dcp_async_k10": b},
                          "verdict": verdict(a is not None and b is not None and a <= b)})
    return found


def _issue_targets(job: str, mine: dict[str, Any], torchrun: dict[str, Any] | None,
                   torchft: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The targets of issue 19: steady overhead, memory vs torchrun, recovery time, and
    recovery vs torchft with the final state bit-identical (torchft's reported too)."""
    overhead, first = mine.get("overhead"), mine.get("kill_to_first_step_s")
    found = [{"job": job, "target": "phalanx steady-state overhead <= 3%", "measured": overhead,
              "verdict": verdict(overhead is not None and overhead <= 0.03)},
             {"job": job, "target": "phalanx kill→first step <= 0.5 s", "measured": first,
              "verdict": verdict(first is not None and first <= 0.5)}]
    if torchrun is not None:
        mem = _ratio(mine.get("peak_host_memory_bytes"), torchrun.get("peak_host_memory_bytes"))
        found.append({"job": job, "target": "phalanx peak memory <= 1.5x torchrun's",
                      "measured": mem, "verdict": verdict(mem is not None and mem <= 1.5)})
    if torchft is not None:
        theirs = torchft.get("kill_to_first_step_s")
        same = mine.get("identical_to_fault_free")
        found.append({"job": job, "target": "phalanx recovers faster than torchft, bit-identical",
                      "measured": {"phalanx_s": first, "torchft_s": theirs,
                                   "phalanx_identical": same,
                                   "torchft_identical": torchft.get("identical_to_fault_free")},
                      "verdict": verdict(first is not None and theirs is not None
                                         and first < theirs and same is True)})
    return found


def scaling_of(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median recovery time and lost steps per (system, world) of the mlp runs that the
    scaling plot compares (the world-2 main runs included)."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for run in runs:
        if run["job"] == "mlp" and run["system"] in SCALING_SYSTEMS and run.get("ok"):
            cells.setdefault((run["system"], run["world"]), []).append(run)
    return [{"system": key, "world": world, "runs": len(found),
             "kill_to_first_step_s": med([r["kill_to_first_step_s"] for r in found]),
             "lost_steps": med([r["lost_steps"] for r in found])}
            for (key, world), found in sorted(cells.items())]


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# phalanx vs torchrun + DCP vs torchft ({'quick' if report['quick'] else 'full'} "
             "run)", "",
             f"Machine: {report['machine'].get('cpus')} CPUs, "
             f"{report['machine'].get('mem_total_kib', 0) / 2**20:.1f} GiB RAM, "
             f"torch {report['machine'].get('torch')}, {report['machine'].get('platform')}. "
             f"Medians over {report['repeats']} repeat(s) per mlp cell, "
             f"{report['transformer_repeats']} per transformer cell. Fault: SIGKILL of rank "
             f"{report['target_rank']} once it completed the fault step.", ""]
    for job, cells in report["summary"].items():
        meta = report["jobs"][job]
        lines += [f"## {job} (world {meta['world']}, "
                  f"state {meta['state_mib'] or '?'} MiB per rank)", "",
                  f"{meta['steps']} steps, fault at step {meta['fault_step']}. Start-up = launch "
                  "→ first step done by every rank; warm-up = mean step over steps "
                  f"1..{meta['warmup_end'] - 1}; steady state = mean step over steps "
                  f"{meta['steady_window'][0]}..{meta['steady_window'][1] - 1}; capture window "
                  f"= steps {meta['capture_window'][0]}..{meta['capture_window'][1] - 1} (the "
                  "last 50 before the fault, the bench's step time before it told start-up "
                  "apart). Overheads vs torchrun without checkpoints.", ""]
        snapshot = next((r.get("snapshot_config") for r in report["runs"]
                         if r["job"] == job and r["system"] == "phalanx"
                         and r.get("snapshot_config")), None)
        if snapshot:
            lines += ["phalanx ran with `snapshot: " + json.dumps(snapshot, sort_keys=True)
                      + "` (its run directory's config.yaml).", ""]
        lines += [markdown_table(["system", "wall s", "start-up s", "warm-up step ms",
                                  "steady step ms", "overhead", "window step ms",
                                  "window overhead"], [_step_row(c) for c in cells.values()]), ""]
        lines += [markdown_table(["system", "kill→first step s", "kill→regained s",
                                  "lost steps", "degraded steps", "written MiB", "peak mem MiB",
                                  "params = fault-free", "ok"],
                                 [_fault_row(c) for c in cells.values()]), ""]
        lines += [f"- {c['label']}: params differ because {c['differs_because']}."
                  for c in cells.values() if c.get("differs_because")]
        lines += [""] if any(c.get("differs_because") for c in cells.values()) else []
        lines += _goodput_table(cells)
        lines += _memory_table(cells)
        ratios = report["ratios"].get(job, {})
        if ratios:
            lines += ["phalanx / peer ratios (below 1: phalanx is lower):", "",
                      markdown_table(["vs", "start-up", "steady step", "recovery", "regained",
                                      "lost steps", "wall", "written", "peak mem"],
                                     [[cells[k]["label"], r["startup_s"], r["steady_step_s"],
                                       r["kill_to_first_step_s"], r["kill_to_regained_s"],
                                       r["lost_steps"], r["wall_s"], r["bytes_written"],
                                       r["peak_host_memory_bytes"]]
                                      for k, r in ratios.items()]), ""]
    if report["scaling"]:
        lines += ["## Recovery vs world size (mlp)", "",
                  markdown_table(["system", "world", "kill→first step s", "lost steps", "runs"],
                                 [[c["system"], c["world"], c["kill_to_first_step_s"],
                                   c["lost_steps"], c["runs"]] for c in report["scaling"]]), ""]
    lines += ["## Targets", "",
              markdown_table(["job", "target", "measured", "verdict"],
                             [[t["job"], t["target"], json.dumps(t["measured"]), t["verdict"]]
                              for t in report["targets"]]), ""]
    failed = [r for r in report["runs"] if not r["ok"]]
    if failed:
        lines += ["## Failed runs", ""] + [f"- {r['name']}: {r.get('error')}" for r in failed]
    return "\n".join(lines) + "\n"


def _step_row(cell: dict[str, Any]) -> list[Any]:
    return [cell["label"], cell["wall_s"], cell["startup_s"], ms(cell["warmup_step_s"]),
            ms(cell["steady_step_s"]), _pct(cell["overhead"]), ms(cell["window_step_s"]),
            _pct(cell["window_overhead"])]


def _fault_row(cell: dict[str, Any]) -> list[Any]:
    return [cell["label"], cell["kill_to_first_step_s"], cell["kill_to_regained_s"],
            cell["lost_steps"], cell["degraded_steps"], _mib(cell["bytes_written"]),
            _mib(cell["peak_host_memory_bytes"]), _same(cell["identical_to_fault_free"]),
            f"{cell['ok_runs']}/{cell['runs']}"]


def _memory_table(cells: dict[str, dict[str, Any]]) -> list[str]:
    """Per system: its peak host memory split by what held it (MiB)."""
    parts = {c["label"]: c["peak_memory_parts"] for c in cells.values()
             if c.get("peak_memory_parts")}
    if not parts:
        return []
    names = sorted({n for p in parts.values() for n in p},
                   key=lambda n: (-max(p.get(n, 0) for p in parts.values()), n))
    rows = [[label, _mib(sum(p.values())), *[_mib(p.get(n)) if n in p else "-" for n in names]]
            for label, p in parts.items()]
    return ["Peak host memory by part (MiB; private memory of each kind of process and the "
            "growth of /dev/shm, at the sample of the peak, in the run nearest the median "
            "peak):", "", markdown_table(["system", "peak", *names], rows), ""]


def _goodput_table(cells: dict[str, dict[str, Any]]) -> list[str]:
    """Per system: effective training time and the wall time's parts (seconds)."""
    rows = []
    for cell in cells.values():
        g = cell.get("goodput")
        if not g:
            rows.append([cell["label"]] + ["-"] * 9)
            continue
        rows.append([cell["label"], f"{g['effective'] * 100:.1f}%", g["wall_s"], g["startup_s"],
                     g["productive_s"], g["redone_s"], g["snapshot_stall_s"],
                     round(sum(g["recovery_s"].values()), 4), g["shutdown_s"], g["sum_s"]])
    return ["Goodput (one run per system, the median effective share; the parts sum to the "
            "wall time; stall = DCP save blocking or phalanx snapshot stall):", "",
            markdown_table(["system", "effective", "wall s", "startup s", "productive s",
                            "redone s", "stall s", "recovery s", "shutdown s", "sum s"], rows),
            ""]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 2)


def _pct(share: float | None) -> str:
    return "-" if share is None else f"{share * 100:+.1f}%"


def _mib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / 2**20, 1)


def _same(flag: bool | None) -> str:
    return "-" if flag is None else ("yes" if flag else "NO")


PALETTE = ("tab:blue", "tab:orange", "tab:purple", "tab:red", "tab:brown", "tab:pink")


def _color(key: str, index: int) -> str:
    if key == "torchft":
        return "tab:gray"
    return "tab:green" if key == "phalanx" else PALETTE[index % len(PALETTE)]


def plot(path: Path, report: dict[str, Any]) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress(f"matplotlib is not installed: skipped {path}")
        return False
    jobs = list(report["summary"])
    keys = [k for k in report["summary"][jobs[0]] if k != "torchrun"] if jobs else []
    panels = [("kill_to_first_step_s", "kill → first step after recovery (s)", True),
              ("kill_to_regained_s", "kill → back at the step reached (s)", True),
              ("lost_steps", "lost (recomputed) steps", False),
              ("startup_s", "start-up: launch → first step (s)", False),
              ("overhead", "steady-state overhead vs no checkpoints", False)]
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(32, 5))
    width = 0.8 / max(1, len(keys))
    for ax, (metric, title, log) in zip(axes, panels):
        log = log and any((report["summary"][job].get(key, {}).get(metric) or 0) > 0
                          for job in jobs for key in keys)   # a log axis needs a value
        for i, key in enumerate(keys):
            values = [report["summary"][job].get(key, {}).get(metric) for job in jobs]
            xs = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(jobs))]
            ax.bar(xs, [v if v is not None else 0 for v in values], width,
                   label=report["summary"][jobs[0]][key]["label"],
                   color=_color(key, i))
        ax.set_xticks(range(len(jobs)), jobs)
        ax.set_title(title)
        if log:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for key in sorted({c["system"] for c in report["scaling"]}):
        cells = [c for c in report["scaling"] if c["system"] == key]
        ax.plot([c["world"] for c in cells], [c["kill_to_first_step_s"] for c in cells],
                marker="o", label=key)
    ax.set_xlabel("world size")
    ax.set_ylabel("kill → first step (s)")
    ax.set_title("recovery vs world size (mlp)")
    if report["scaling"]:
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.suptitle("phalanx vs torchrun + DCP vs torchft: same job, same SIGKILL")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
