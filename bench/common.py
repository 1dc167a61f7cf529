"""Small helpers shared by the benchmarks in ``bench/``: timing, progress lines, JSON,
markdown tables and an optional PNG bar chart (matplotlib is used when importable).

A bench runs as ``python bench/<name>.py``: it puts ``repo_root()`` (computed from its own
``__file__``) on ``sys.path`` before importing ``bench.common`` and ``runtime``.
"""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

MiB = 1 << 20
GB = 1e9


def progress(message: str) -> None:
    """One line per measurement, flushed at once (benches run for minutes)."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def time_calls(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def summary(samples: Sequence[float]) -> dict[str, Any]:
    """``{"median", "min", "max", "samples"}`` of a list of seconds (or any numbers)."""
    return {"median": median(samples), "min": min(samples), "max": max(samples),
            "samples": list(samples)}


def gbps(nbytes: int, seconds: float) -> float:
    """Decimal GB/s (1e9 bytes), as PCIe and memory bandwidths are usually quoted."""
    return nbytes / seconds / GB if seconds > 0 else math.inf


def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "platform": platform.platform(),
                            "cpus": os.cpu_count()}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            info["mem_total_kib"] = int(fh.readline().split()[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        import torch
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return info


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON (atomically: temp file, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1, default=str, allow_nan=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, path)
    return path


def fmt(value: Any, digits: int = 3) -> str:
    """A table cell: floats to ``digits`` significant figures, None as '-'."""
    if value is None:
        return "-"
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 10 ** digits else f"{value:.0f}"
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub-flavoured markdown table; cells go through ``fmt``."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(fmt(cell) for cell in row) + " |")
    return "\n".join(lines)


def bar_chart(path: str | os.PathLike, panels: Sequence[Mapping[str, Any]],
              title: str = "") -> bool:
    """Grouped bar charts side by side, one per panel, saved as a PNG.

    Each panel: ``{"title", "ylabel", "groups": [x labels], "series": {name: [values]},
    "log": bool}``. Returns False (and prints a note) when matplotlib is not importable.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        progress(f"matplotlib is not installed: skipped {path}")
        return False
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.5), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        groups, series = list(panel["groups"]), dict(panel["series"])
        width = 0.8 / max(1, len(series))
        for i, (name, values) in enumerate(series.items()):
            xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
            ax.bar(xs, [v if v is not None else 0 for v in values], width, label=name)
        ax.set_xticks(range(len(groups)), groups)
        ax.set_title(panel.get("title", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        if panel.get("log"):
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent
