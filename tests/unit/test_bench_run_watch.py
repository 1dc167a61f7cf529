"""bench/run_watch.py: the peak host memory of a run's process tree, split by part."""
from __future__ import annotations

import subprocess
import sys
import time

from bench.run_watch import MemorySampler, part_of
from bench.vs_torchrun_report import markdown, summarize

# a root that starts one child holding 64 MiB of written (private) memory for 3 s
_TREE = ("import subprocess, sys; subprocess.run([sys.executable, '-c', "
         "'import time; b = bytearray(64 << 20); b[::4096] = b\"x\" * (len(b) // 4096); "
         "time.sleep(3)'])")


def test_the_peak_is_split_into_the_launcher_and_the_processes_below_it() -> None:
    root = subprocess.Popen([sys.executable, "-c", _TREE])
    sampler = MemorySampler(root.pid)
    sampler.start()
    root.wait(timeout=30)
    peak = sampler.stop()
    assert peak >= 64 << 20
    assert set(sampler.parts) >= {"launcher", "workers"}
    assert sampler.parts["workers"] >= 64 << 20 > sampler.parts["launcher"]
    assert sum(sampler.parts.values()) == peak


def test_a_process_is_named_by_its_command_line() -> None:
    procs = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)", argv])
             for name, argv in (("keepers", "ray::KeeperActor"), ("ranks", "ray::WorkerActor.run"),
                                ("spares", "ray::WorkerActor"), ("ray", "ray::IDLE"),
                                ("workers", "--job=mlp"))}
    try:
        time.sleep(0.2)
        assert {name: part_of(p.pid, root=0) for name, p in procs.items()} == \
            {name: name for name in procs}
        assert part_of(procs["workers"].pid, root=procs["workers"].pid) == "launcher"
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_the_report_tables_where_each_system_s_peak_went() -> None:
    base = {"purpose": "main", "job": "mlp", "ok": True, "hash": "h", "steady_step_s": 0.1}
    runs = [{**base, "system": "torchrun", "peak_host_memory_bytes": 3 << 20,
             "peak_memory_parts": {"launcher": 1 << 20, "workers": 2 << 20}},
            {**base, "system": "phalanx", "peak_host_memory_bytes": 7 << 20,
             "peak_memory_parts": {"launcher": 1 << 20, "ranks": 2 << 20,
                                   "shared memory": 4 << 20}}]
    summary = summarize(runs, {"torchrun": "torchrun", "phalanx": "phalanx"}, {"mlp": "h"})
    assert summary["mlp"]["phalanx"]["peak_memory_parts"]["shared memory"] == 4 << 20
    report = {"quick": True, "machine": {"cpus": 2}, "repeats": 1, "transformer_repeats": 1,
              "target_rank": 1, "summary": summary, "ratios": {}, "targets": [],
              "scaling": [], "runs": runs,
              "jobs": {"mlp": {"world": 2, "state_mib": 0.04, "steps": 200, "fault_step": 174,
                               "warmup_end": 40, "steady_window": [74, 174],
                               "capture_window": [124, 174]}}}
    text = markdown(report)
    assert "| system | peak | shared memory | ranks | workers | launcher |" in text
    assert "| phalanx | 7 | 4 | 2 | - | 1 |" in text
    assert "| torchrun | 3 | - | - | 2 | 1 |" in text
