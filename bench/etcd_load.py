"""Steady-state etcd load of a real ``phalanx launch``: writes and requests per second, per
key class, while every rank trains (issue 21, item 4's "before" and "after" figure).

    python bench/etcd_load.py [--world 8] [--nodes 4] [--window-s 20] [--set KEY=VALUE ...]

Starts a private etcd (the launcher's ``EmbeddedEtcd``), runs ``phalanx launch
configs/demo.yaml`` against it (``etcd.endpoints``), waits until every rank has completed
``--warmup-steps``, then reads etcd's ``/metrics`` counters before and after a window of
``--window-s`` seconds while a prefix watch tallies every change per key class. Then it
interrupts the launch (SIGINT) and stops etcd. Writes ``bench/results/etcd_load.json``.
Run it alone on the machine (integration lock): other etcd clients do not count, but other
processes slow the ranks down.
"""
from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import machine_info, markdown_table, progress, write_json  # noqa: E402
from bench.etcd_probe import WatchTally, rates, scrape  # noqa: E402
from phalanx.launcher.services.etcd_server import EmbeddedEtcd  # noqa: E402
from phalanx.runtime.membership.etcd import EtcdMembership, job_prefix  # noqa: E402

JOB = "etcd-load"


def launch_command(args: argparse.Namespace, endpoint: str, run_root: Path) -> list[str]:
    job_args = {"steps": args.steps, "sleep_per_step_s": args.sleep_per_step}
    sets = [f"job.name={JOB}", f"job.run_dir={run_root}", f"job.world_size={args.world}",
            f"job.nodes={args.nodes}", f"ray.virtual_nodes={args.nodes}",
            f"ray.cpus_per_node={args.cpus_per_node}", f"job.args={json.dumps(job_args)}",
            f"etcd.endpoints=[{endpoint}]", "job.timeout_s=900", *args.set]
    cmd = [sys.executable, "-m", "phalanx.launcher.cli", "launch", str(ROOT / "configs/demo.yaml")]
    for item in sets:
        cmd += ["--set", item]
    return cmd


def rank_steps(membership: EtcdMembership) -> dict[int, int]:
    return {m.rank: m.step for m in membership.members().values() if m.rank >= 0}


def wait_for_training(membership: EtcdMembership, proc: subprocess.Popen[bytes], world: int,
                      warmup: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        steps = rank_steps(membership)
        if len(steps) >= world and min(steps.values()) >= warmup:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"phalanx launch exited with {proc.returncode} before every rank "
                               f"reached step {warmup} (steps {steps}); see its log")
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks did not all reach step {warmup} within {timeout_s} s: "
                               f"{steps}")
        time.sleep(0.5)


def lease_count(endpoint: str) -> int:
    """The leases etcd holds now (``etcdctl lease list``, shipped with the embedded etcd)."""
    etcdctl = Path(sys.executable).parent / "etcdctl"
    out = subprocess.run([str(etcdctl), f"--endpoints={endpoint}", "lease", "list"],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(out.split()[1])      # "found N leases"


def measure(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    etcd = EmbeddedEtcd(work / "etcd").start()
    membership = EtcdMembership([etcd.endpoint], job_prefix("/phalanx", JOB)).connect()
    log_path = work / "launch.log"
    cmd = launch_command(args, etcd.endpoint, work / "runs")
    proc = None
    try:
        with open(log_path, "wb") as log_fh:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_fh, stderr=subprocess.STDOUT)
            progress(f"launched world {args.world} on {args.nodes} nodes; etcd {etcd.endpoint}")
            wait_for_training(membership, proc, args.world, args.warmup_steps, args.start_timeout_s)
            progress(f"every rank at step >= {args.warmup_steps}; measuring {args.window_s} s")
            tally = WatchTally(membership.watch_prefix).start()
            steps_before, before = rank_steps(membership), scrape(etcd.endpoint)
            started = time.monotonic()
            time.sleep(args.window_s)
            after, seconds = scrape(etcd.endpoint), time.monotonic() - started
            steps_after, watched = rank_steps(membership), tally.stop()
            members = membership.members()
            leases = lease_count(etcd.endpoint)
            samples = {kv.key: kv.value.decode() for kv in membership.list_prefix("")
                       if kv.key in ("keepers/node1", "commit")}   # node1 carries its ranks' records
            if proc.poll() is not None:
                raise RuntimeError(f"phalanx launch exited ({proc.returncode}) during the window")
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=120)
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        membership.close()
        etcd.close()
    per_s = rates(before, after, seconds)
    steps_per_s = {r: (steps_after.get(r, 0) - s) / seconds for r, s in steps_before.items()}
    classes = {name: {"events_per_s": c["events"] / seconds, "bytes_per_s": c["bytes"] / seconds}
               for name, c in watched["classes"].items()}
    records = {"ranks": sum(1 for m in members.values() if m.rank >= 0),
               "keepers": sum(1 for m in members.values() if m.extra.get("role") == "keeper"),
               "other": sum(1 for m in members.values()
                            if m.rank < 0 and m.extra.get("role") != "keeper")}
    return {"world": args.world, "nodes": args.nodes, "window_s": seconds, "etcd": per_s,
            "samples": samples, "watch": classes, "launcher_events": watched["event_names"],
            "steps_per_s": steps_per_s, "members": records, "leases": leases,
            "command": " ".join(cmd[:5]) + " " + " ".join(f"--set '{c}'" for c in cmd[6::2]),
            "machine": machine_info()}


def report(result: dict[str, Any]) -> str:
    etcd, steps = result["etcd"], result["steps_per_s"]
    mean_steps = sum(steps.values()) / max(1, len(steps))
    lines = [f"world {result['world']} on {result['nodes']} nodes, {result['window_s']:.1f} s "
             f"window, {mean_steps:.2f} steps/s per rank; member records: {result['members']}; "
             f"etcd leases held: {result['leases']}", "",
             markdown_table(["what", "per s"], [
                 ["keys written (etcd_mvcc_put_total)", etcd["puts"]],
                 ["transactions", etcd["txns"]], ["deletes", etcd["deletes"]],
                 ["raft proposals committed", etcd["proposals"]],
                 ["lease keepalives", etcd["lease_renewals"]],
                 ["range reads", etcd["ranges"]],
                 ["bytes received by etcd", etcd["rx_bytes"]],
                 ["bytes sent by etcd", etcd["tx_bytes"]]]), "",
             markdown_table(["key class", "changes/s", "bytes/s"],
                            [[k, v["events_per_s"], v["bytes_per_s"]]
                             for k, v in result["watch"].items()]), "",
             f"launcher events in the window: {result['launcher_events']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--nodes", type=int, default=4)
    parser.add_argument("--cpus-per-node", type=int, default=8)
    parser.add_argument("--steps", type=int, default=100000, help="never reached: SIGINT ends it")
    parser.add_argument("--sleep-per-step", type=float, default=0.05)
    parser.add_argument("--warmup-steps", type=int, default=10)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--set", action="append", default=[], help="extra launch override")
    parser.add_argument("--out", default=str(ROOT / "bench/results/etcd_load.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="phalanx-etcd-load-") as tmp:
        try:
            result = measure(args, Path(tmp))
        except Exception:
            log = Path(tmp) / "launch.log"
            if log.exists():
                print(log.read_text(errors="replace")[-4000:], file=sys.stderr)
            raise
    print(report(result))
    write_json(args.out, result)
    progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
