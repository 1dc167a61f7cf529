"""``bench/scale_sim.py``'s etcd half at a tiny size against a real etcd (issue 21, item 5):
the records are stored and read back, the fence writes the plan, the heartbeats reach their
rate and a recovery's burst writes three keys per rank."""
from __future__ import annotations

import argparse

import pytest

from bench import scale_sim

pytestmark = pytest.mark.integration


@pytest.mark.timeout(120)
def test_a_tiny_job_against_a_real_etcd_measures_every_etcd_figure() -> None:
    args = argparse.Namespace(no_etcd=False, repeats=1, beat_seconds=1.0)
    cell = scale_sim.run([3], args)["cells"][0]
    etcd, derived = cell["etcd"], cell["derived"]
    assert etcd["populate"]["keys"] >= 24 + 3          # 24 member records, 3 keeper reports
    assert etcd["reads"]["members"]["keys"] == 24
    assert etcd["reads"]["members"]["bytes"] == cell["member_table_bytes"]
    assert derived["fence"] == "ok" and etcd["fence"]["plan_bytes"] == cell["plan_encoded_bytes"]
    today = etcd["heartbeats_today"]
    assert today["demand_puts_per_s"] == pytest.approx((24 + 3) / 0.5)
    assert today["puts_per_s"] > 0.8 * today["demand_puts_per_s"]    # paced, not flat out
    assert today["puts_per_s"] < 1.3 * today["demand_puts_per_s"]
    assert today["watch_events_per_s"] == pytest.approx(today["puts_per_s"], rel=0.2)
    assert 500 < today["wire_bytes_per_put"] < 800      # a ~560-byte member record
    assert etcd["recovery"]["writes"] == 3 * 24         # restoring, restored, deleted
    assert etcd["recovery"]["plan_reads"] == 24
