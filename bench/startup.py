"""Start-up time: from the command to the first completed training step, torchrun next to
phalanx, on the DDP example (examples/ddp_torchrun.py, unchanged; and its port
examples/ddp_phalanx.py), same world size, same machine, one script.

    python bench/startup.py [--world 4] [--repeats 3] [--out bench/results/startup.json]

The first step is taken where the script's own optimizer finishes its first ``step()``
(a global optimizer step hook installed by a tiny wrapper around the unchanged script:
the same wrapper for every variant), on rank 0, in wall-clock time from the moment the
command was started. phalanx's own phases come from its run directory (events and rank
logs): services up (``started``), the rank's process running (``worker_run``), first step.
Prints a table of medians, the phalanx/torchrun ratios and the JSON.
"""
from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import markdown_table, median, progress, write_json  # noqa: E402

WRAPPER = '''import os, sys, time, runpy, torch
from torch.optim.optimizer import register_optimizer_step_post_hook
stamp = sys.argv.pop(1)
def first_step(optimizer, args, kwargs):
    if not getattr(first_step, "done", False) and os.environ.get("RANK", "0") == "0":
        first_step.done = True
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
register_optimizer_step_post_hook(first_step)
runpy.run_path({script!r}, run_name="__main__")
'''
TS = re.compile(r"ts=(\S+)Z .*event=worker_run rank=0 ")


def wrapper(work: Path, example: str) -> Path:
    path = work / f"first_step_{Path(example).stem}.py"
    path.write_text(WRAPPER.format(script=str(ROOT / "examples" / example)))
    return path


def run_torchrun(work: Path, world: int, args: list[str]) -> dict[str, Any]:
    stamp = work / "torchrun.stamp"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                           str(world), "--master-port", str(port),
                           str(wrapper(work, "ddp_torchrun.py")), str(stamp), *args],
                          cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"first_step_s": float(stamp.read_text()) - started,
            "total_s": time.time() - started}


def run_phalanx(work: Path, world: int, args: list[str], example: str,
                spares: int) -> dict[str, Any]:
    stamp = work / f"phalanx-{example}.stamp"
    runs = work / "runs"
    started = time.time()
    proc = subprocess.run([sys.executable, "-m", "phalanx.launcher.cli", "run", "--nnodes", "2",
                           "--nproc-per-node", str(world // 2), "--spares", str(spares),
                           "--set", f"job.run_dir={runs}", "--set", "snapshot.rank_size_mb=1",
                           "--set", "job.cpus_per_worker=0.25",
                           str(wrapper(work, example)), str(stamp), *args],
                          cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = float(stamp.read_text()) - started
    run_dir = max(runs.iterdir(), key=lambda p: p.stat().st_mtime)
    events = [json.loads(line) for line in (run_dir / "events.jsonl").open()]
    services = next(e["time"] for e in events if e["event"] == "started") - started
    log = next((run_dir / "logs").glob("rank_0_*.log")).read_text()
    match = TS.search(log)
    running = (datetime.fromisoformat(match.group(1)).timestamp() - started) if match else None
    return {"first_step_s": first, "total_s": time.time() - started,
            "services_up_s": services, "rank_running_s": running}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "startup.json"))
    opts = parser.parse_args()
    args = ["--epochs", "1", "--samples", "256"]
    variants = {"torchrun (unchanged script)": lambda w: run_torchrun(w, opts.world, args),
                "phalanx run (unchanged script)":
                    lambda w: run_phalanx(w, opts.world, args, "ddp_torchrun.py", 0),
                "phalanx run (port, 1 spare)":
                    lambda w: run_phalanx(w, opts.world, args, "ddp_phalanx.py", 1)}
    samples: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    for repeat in range(opts.repeats):
        for name, fn in variants.items():       # interleaved: the machine's drift hits all
            with tempfile.TemporaryDirectory() as tmp:
                result = fn(Path(tmp))
            samples[name].append(result)
            progress(f"repeat {repeat + 1}/{opts.repeats} {name}: first step after "
                     f"{result['first_step_s']:.2f} s")
    base = median(s["first_step_s"] for s in samples["torchrun (unchanged script)"])
    rows, report = [], {"world": opts.world, "repeats": opts.repeats, "variants": {}}
    for name, runs in samples.items():
        first = median(r["first_step_s"] for r in runs)
        phases = {key: median(r[key] for r in runs if r.get(key) is not None)
                  for key in ("services_up_s", "rank_running_s") if runs[0].get(key) is not None}
        report["variants"][name] = {"first_step_s": first, "ratio_to_torchrun": first / base,
                                    **phases, "runs": runs}
        rows.append([name, f"{first:.2f}", f"{first / base:.2f}x",
                     f"{phases['services_up_s']:.2f}" if "services_up_s" in phases else "-",
                     f"{phases['rank_running_s']:.2f}" if "rank_running_s" in phases else "-"])
    print(markdown_table(["variant", "first step s (median)", "vs torchrun",
                          "services up s", "rank 0 running s"], rows))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "runs"}
                      for k, v in report["variants"].items()}, indent=1))
    print(f"json: {write_json(opts.out, report)}")


if __name__ == "__main__":
    main()
