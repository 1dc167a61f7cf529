"""The etcd half of ``bench/scale_sim.py``: a real etcd (the launcher's ``EmbeddedEtcd``)
holding a simulated job's member records and keeper reports under their leases, and what
phalanx asks of it at that size: the launcher's reads of those tables, the fence, the
heartbeats at their steady rate (with a prefix watch counting what a watcher receives), and
a recovery's burst of writes and plan reads.

Populating and the heartbeat load use the ``etcd3`` client directly (one lease per record,
many threads); the launcher's reads and the fence go through phalanx's own adapter.
"""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import etcd3

from bench.etcd_probe import WatchTally, rates, scrape
from bench.scale_model import STEP, Job, member_value, node_progress_value
from phalanx.configs.errors import MembershipUnavailable
from phalanx.launcher.services.etcd_server import EmbeddedEtcd
from phalanx.runtime.base import decode_member
from phalanx.runtime.membership.etcd import EtcdMembership, job_prefix
from phalanx.runtime.membership.generation import GENERATION_KEY, plan_key

JOB = "scale"
PREFIX = job_prefix("/phalanx", JOB)
THREADS = 8
LEASE_TTL_S = 1800        # the bench's leases outlive it; their keepalives are modelled


@dataclass
class EtcdBench:
    """One etcd for every size, grown in place: leases are granted once per worker/node."""

    work: Path
    etcd: EmbeddedEtcd | None = None
    membership: EtcdMembership | None = None
    clients: list[Any] = field(default_factory=list)
    leases: dict[str, int] = field(default_factory=dict)
    generation: int = 0

    def start(self) -> EtcdBench:
        self.etcd = EmbeddedEtcd(self.work / "etcd").start()
        host, port = self.etcd.endpoint.split(":")
        self.clients = [etcd3.client(host, int(port), timeout=30) for _ in range(THREADS)]
        self.membership = EtcdMembership([self.etcd.endpoint], PREFIX).connect()
        self.membership.put(GENERATION_KEY, b"0")
        return self

    def close(self) -> None:
        if self.membership is not None:
            self.membership.close()
        for client in self.clients:
            client.close()
        if self.etcd is not None:
            self.etcd.close()

    @property
    def endpoint(self) -> str:
        assert self.etcd is not None
        return self.etcd.endpoint

    def etcd_cpu_s(self) -> float:
        """etcd's user + system CPU seconds so far (/proc)."""
        assert self.etcd is not None and self.etcd.pid is not None
        fields = Path(f"/proc/{self.etcd.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    # -- populating -----------------------------------------------------------------------

    def populate(self, job: Job) -> dict[str, float]:
        """Every rank's member record and every node's keeper report, each under its own
        lease (as today). Returns the seconds it took and the keys etcd then holds."""
        items = [(f"members/w{r}-g0", member_value(r, n, STEP)) for r, n in job.rank_nodes.items()]
        items += [(f"keepers/{n}", rep.to_json()) for n, rep in job.reports.items()]
        started = time.perf_counter()
        self._parallel(items, self._leased_put)
        return {"seconds": time.perf_counter() - started,
                "keys": scrape(self.endpoint)["keys"], "db_bytes": scrape(self.endpoint)["db_bytes"]}

    def _leased_put(self, client: Any, key: str, value: bytes) -> None:
        lease = self.leases.get(key)
        if lease is None:
            lease = self.leases[key] = client.lease(LEASE_TTL_S).id
        client.put(PREFIX + key, value, lease=lease)

    def _parallel(self, items: list[tuple[str, bytes]],
                  op: Callable[[Any, str, bytes], None]) -> None:
        def run(part: int) -> None:
            client = self.clients[part]
            for key, value in items[part::THREADS]:
                op(client, key, value)
        with ThreadPoolExecutor(THREADS) as pool:
            list(pool.map(run, range(THREADS)))

    # -- the launcher's reads ----------------------------------------------------------------

    def launcher_reads(self, repeats: int) -> dict[str, Any]:
        """One poll's member table and the commit tracker's keeper reports, as the launcher
        reads them (phalanx's adapter): seconds, bytes, and the CPU to decode the members."""
        assert self.membership is not None
        out: dict[str, Any] = {}
        for table in ("members/", "keepers/"):
            times, payload = [], 0
            try:
                for _ in range(repeats):
                    started = time.perf_counter()
                    kvs = self.membership.list_prefix(table)
                    times.append(time.perf_counter() - started)
                payload = sum(len(kv.key) + len(PREFIX) + len(kv.value) for kv in kvs)
            except MembershipUnavailable as exc:
                out[table.rstrip("/")] = {"error": str(exc)[:300]}
                continue
            entry: dict[str, Any] = {"keys": len(kvs), "bytes": payload,
                                     "seconds": statistics.median(times)}
            if table == "members/":
                started = time.perf_counter()
                for kv in kvs:
                    decode_member(kv.value)
                entry["decode_s"] = time.perf_counter() - started
            out[table.rstrip("/")] = entry
        return out

    # -- the fence ------------------------------------------------------------------------------

    def fence(self, plan_json: bytes, repeats: int) -> dict[str, Any]:
        """The coordinator's fence: read ``generation``, then one transaction that writes
        ``plan/<g+1>`` and ``generation`` if its revision is unchanged. Median seconds."""
        assert self.membership is not None
        times: list[float] = []
        for _ in range(repeats):
            started = time.perf_counter()
            try:
                current = self.membership.get(GENERATION_KEY)
                assert current is not None
                nxt = int(current.value) + 1
                ok = self.membership.put_if(GENERATION_KEY, current.mod_revision, {
                    plan_key(nxt): plan_json, GENERATION_KEY: str(nxt).encode()})
            except MembershipUnavailable as exc:
                return {"ok": False, "plan_bytes": len(plan_json), "error": str(exc)[:300]}
            times.append(time.perf_counter() - started)
            if not ok:
                return {"ok": False, "plan_bytes": len(plan_json), "error": "fence lost"}
            self.generation = nxt
        return {"ok": True, "plan_bytes": len(plan_json), "seconds": statistics.median(times)}

    # -- steady heartbeats --------------------------------------------------------------------

    def heartbeats(self, job: Job, per_node: bool, rate: float, seconds: float) -> dict[str, Any]:
        """Write the heartbeats at ``rate`` puts/s (or as fast as the bench's threads can)
        for ``seconds``: today each rank's member record under its lease, per node one
        aggregated record. etcd's counters give the puts done and the bytes on the wire; a
        prefix watch (phalanx's adapter) counts what a watcher of the job receives. Today's
        rate includes the keepers' reports; they are written here as member records (the
        same rate, records of about the same size)."""
        assert self.membership is not None
        if per_node:
            ranks_of: dict[str, list[int]] = {}
            for rank, node in job.rank_nodes.items():
                ranks_of.setdefault(node, []).append(rank)
            items = [(f"keepers/{n}", node_progress_value(n, rs, STEP)) for n, rs in ranks_of.items()]
        else:
            items = [(f"members/w{r}-g0", member_value(r, n, STEP))
                     for r, n in job.rank_nodes.items()]
        threads = min(THREADS, len(items))      # 3 nodes: 3 records, 3 writers
        latencies: list[list[float]] = [[] for _ in range(threads)]
        stop_at = time.monotonic() + seconds
        per_thread = rate / threads

        def drive(part: int) -> None:
            client, mine, lat = self.clients[part], items[part::threads], latencies[part]
            started, n = time.monotonic(), 0
            while time.monotonic() < stop_at:
                wait = started + n / per_thread - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                key, value = mine[n % len(mine)]
                t0 = time.perf_counter()
                self._leased_put(client, key, value)
                lat.append(time.perf_counter() - t0)
                n += 1

        tally = WatchTally(self.membership.watch_prefix).start()
        before, cpu0, t0 = scrape(self.endpoint), self.etcd_cpu_s(), time.monotonic()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(drive, range(threads)))
        elapsed = time.monotonic() - t0
        after, cpu1 = scrape(self.endpoint), self.etcd_cpu_s()
        time.sleep(0.2)          # the watch delivers the last events
        watched = tally.stop()
        got = rates(before, after, elapsed)
        flat = sorted(x for lat in latencies for x in lat)
        puts = max(1.0, after["puts"] - before["puts"])
        return {"demand_puts_per_s": rate, "puts_per_s": got["puts"],
                "db_growth_bytes_per_put": (after["db_bytes"] - before["db_bytes"]) / puts,
                "met": got["puts"] >= 0.95 * rate,
                "wire_bytes_per_put": (after["rx_bytes"] - before["rx_bytes"]) / puts,
                "value_bytes": statistics.mean(len(v) for _, v in items),
                "put_p50_ms": 1e3 * flat[len(flat) // 2] if flat else None,
                "put_p99_ms": 1e3 * flat[int(len(flat) * 0.99)] if flat else None,
                "etcd_cpu_share": (cpu1 - cpu0) / elapsed,
                "watch_events_per_s": watched["events"] / elapsed,
                "watch_bytes_per_s": watched["bytes"] / elapsed}

    # -- a recovery's burst ---------------------------------------------------------------------

    def recovery_burst(self, job: Job, plan_bytes: int, fenced: bool,
                       plan_readers: int) -> dict[str, Any]:
        """Every rank's restore report (restoring, restored), then the launcher's deletes,
        as fast as the bench's threads go; and, when this size's plan was fenced,
        ``plan_readers`` ranks reading it (every rank reads it: the total is extrapolated
        from their rate)."""
        keys = [(f"restore/{self.generation}/{r}", b'{"worker":"w%d-g1","state":"restoring",'
                 b'"started":1796196494.89,"time":1796196495.42}' % r) for r in range(job.ranks)]
        before, started = scrape(self.endpoint), time.perf_counter()
        self._parallel(keys, lambda c, k, v: c.put(PREFIX + k, v))
        self._parallel(keys, lambda c, k, v: c.put(PREFIX + k, v.replace(b"restoring", b"restored")))
        self._parallel(keys, lambda c, k, _: c.delete(PREFIX + k))
        burst_s, after = time.perf_counter() - started, scrape(self.endpoint)
        out: dict[str, Any] = {"writes": after["puts"] + after["deletes"] - before["puts"]
                               - before["deletes"], "seconds": burst_s}
        out["writes_per_s"] = out["writes"] / burst_s
        out["all_ranks_plan_bytes"] = plan_bytes * job.ranks
        key = PREFIX + plan_key(self.generation)
        value, _ = self.clients[0].get(key)
        if not fenced or value is None or len(value) != plan_bytes:
            return {**out, "plan_read": "this size's plan could not be fenced"}
        readers = [(key, b"")] * plan_readers
        started = time.perf_counter()
        self._parallel(readers, lambda c, k, _: c.get(k))
        read_s = time.perf_counter() - started
        out.update(plan_bytes=len(value), plan_reads=plan_readers, plan_reads_s=read_s,
                   all_ranks_plan_bytes=len(value) * job.ranks,
                   all_ranks_plan_read_s=read_s / plan_readers * job.ranks)
        return out
