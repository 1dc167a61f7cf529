"""Replication, measured two ways in one run:

1. throughput: keeper-to-keeper replication of a 256 MiB snapshot vs raw loopback TCP on
   the same machine (``bench/replication_throughput.py``), target >= 70% of raw;
2. overhead: the example job's training-loop time with snapshots + replication at the
   default settings (``snapshot.every_steps: auto``) vs snapshots off, both launched with
   ``phalanx launch`` (world 2 on 2 virtual nodes), target <= 3%.

``python bench/replication.py [--quick] [--repeats 3] [--steps 1600] [--out bench/results]``; prints a
markdown table and writes ``replication.json``. Medians over the repeats (overheads: of the
per-repeat overheads, see ``overhead``).
"""
from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import replication_throughput  # noqa: E402
from bench.common import machine_info, markdown_table, progress, verdict, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TRAINED_RE = re.compile(r"rank (\d+) trained (\d+) steps in ([0-9.]+) s")


def loop_seconds(overrides: list[str], run_root: Path) -> float:
    """Median over ranks of the training-loop time of one launched job."""
    cmd = [sys.executable, "-m", "launcher.cli", "launch", str(ROOT / "configs/demo.yaml"),
           "--set", f"job.run_dir={run_root}"]
    for item in overrides:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed: {proc.stderr[-2000:]}")
    run_dir = Path(proc.stdout.strip().splitlines()[-1].split(": ", 1)[1])
    times = [float(m.group(3)) for log in (run_dir / "logs").iterdir()
             for m in TRAINED_RE.finditer(log.read_text())]
    return statistics.median(times)


def overhead(steps: int, repeats: int) -> dict:
    """Loop time per mode; the overhead of a mode is the median over repeats of its
    per-repeat overhead against the snapshots-off run of the same repeat (launches differ
    by up to 10% on this machine, so only neighbours are compared). The order of the modes
    rotates each repeat, so no mode always follows the same one."""
    job = ["job.world_size=2", "spares.count=0", f"job.args.steps={steps}",
           "job.args.sleep_per_step_s=0", "tiers.disk.enabled=false"]
    modes = {"snapshots off": ["snapshot.enabled=false"],
             "keepers up, no snapshot due": [f"snapshot.every_steps={steps * 10}",
                                             "replication.enabled=false"],
             "snapshots only (auto)": ["snapshot.every_steps=auto", "replication.enabled=false"],
             "snapshots + replication (auto)": ["snapshot.every_steps=auto"],
             "snapshots + replication (every step)": ["snapshot.every_steps=1"]}
    names = list(modes)
    samples: dict[str, list[float]] = {name: [] for name in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            shift = repeat % len(names)
            for name in names[shift:] + names[:shift]:
                seconds = loop_seconds(job + modes[name], Path(tmp))
                samples[name].append(seconds)
                progress(f"overhead repeat {repeat + 1}/{repeats} {name}: {seconds:.3f} s")
    medians = {name: statistics.median(values) for name, values in samples.items()}
    base = samples["snapshots off"]
    paired = {name: statistics.median((v - b) / b for v, b in zip(values, base))
              for name, values in samples.items()}
    return {"steps": steps, "samples_s": samples, "median_s": medians, "overhead": paired,
            "overhead_of_medians": {name: (value - medians["snapshots off"])
                                    / medians["snapshots off"]
                                    for name, value in medians.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="16 MiB, 1 repeat, 100 steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=1600,
                        help="steps per launch (long runs average out start-up noise)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = parser.parse_args(argv)
    mib, repeats, steps = (16, 1, 100) if args.quick else (256, args.repeats, args.steps)
    progress(f"throughput: {mib} MiB snapshot, replication vs raw loopback")
    raw = replication_throughput.raw_loopback(mib << 20, 5)
    run = replication_throughput.replication(mib << 20, 7, "sum64")
    raw_median = statistics.median(raw)
    throughput = {"mib": mib, "raw_gbps_median": raw_median,
                  "replication_gbps_median": run["steady_median_gbps"],
                  "ratio_median": run["steady_median_gbps"] / raw_median}
    cost = overhead(steps, repeats)
    auto = cost["overhead"]["snapshots + replication (auto)"]
    rows = [("replication / raw loopback (median)",
             f"{throughput['replication_gbps_median']:.2f} / {raw_median:.2f} GB/s",
             f"{throughput['ratio_median']:.2f}", ">= 0.70",
             verdict(throughput["ratio_median"] >= 0.7))]
    for name, value in cost["overhead"].items():
        target = "<= 3%" if "auto" in name else ""
        rows.append((f"loop time, {name}", f"{cost['median_s'][name]:.3f} s", f"{value:+.1%}*",
                     target, verdict(value <= 0.03) if target else ""))
    print(markdown_table(("measure", "value", "ratio / overhead", "target", "result"), rows))
    print("* median over repeats of the overhead against the same repeat's snapshots-off run")
    write_json(Path(args.out) / "replication.json",
               {"machine": machine_info(), "throughput": throughput, "overhead": cost,
                "targets": {"ratio": 0.7, "overhead_auto": 0.03},
                "passed": {"ratio": throughput["ratio_median"] >= 0.7,
                           "overhead_auto": auto <= 0.03}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
