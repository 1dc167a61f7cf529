"""A process that exits right after re-forming its group exits cleanly (real gloo, real
TCPStore, two fresh interpreters per run that end through Python's normal shutdown). A
reaper thread still inside an abandoned group's destructor at exit used to abort the
process (SIGABRT, "terminate called without an active exception"): as a daemon thread,
Python's finalization cut it off inside a C++ frame that may not unwind (8 ranks of 8
aborted with daemon reapers, measured here)."""
from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from phalanx.runtime.group.collective import Collective
from phalanx.runtime.group.default_group import DefaultGroup
from tests.integration.two_ranks import Rank, on_ranks

pytestmark = pytest.mark.integration
JOB = Path(__file__).parent / "jobs" / "reform_then_exit.py"
RUNS = 3        # one after the other (8 ranks at once did not show the abort)


@pytest.mark.timeout(180)
def test_ranks_exiting_right_after_a_re_form_exit_cleanly() -> None:
    crashed = []
    for run in range(RUNS):
        crashed += _run_pair(run)
    assert not crashed, (f"{len(crashed)} of {2 * RUNS} ranks exiting right after a re-form "
                         f"did not exit 0:\n" + "\n".join(crashed))


def _run_pair(run: int) -> list[str]:
    """One run: both ranks on a fresh TCPStore; what each that did not exit 0 wrote."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    ranks = {rank: subprocess.Popen(
        [sys.executable, str(JOB), "--rank", str(rank), "--port", str(master.port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for rank in (0, 1)}
    crashed = []
    for rank, process in ranks.items():
        try:
            _, err = process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            process.kill()
            _, err = process.communicate()
            err += "\n(killed: still running after 120 s)"
        if process.returncode != 0:
            crashed.append(f"run {run}, rank {rank}: exit code {process.returncode}: "
                           f"{err[-500:]}")
    return crashed


def _reform_finish_and_return(rank: Rank, wait: bool) -> bool:
    """What a rank does at the end of a job right after a recovery: re-form, then (as
    ``Session.close``) wait for its abandoned groups' teardown, then report "finished"
    (the launcher ends the job, every peer process exits, once all ranks finished)."""
    collective = Collective(rank.connect, rank=rank.rank, world_size=2, timeout_s=20.0)
    collective.form(0)
    group = DefaultGroup(collective, skip_setup=False)
    for generation in range(1, 4):
        group.allreduce([torch.ones(3)]).wait()
        group.barrier().wait()
        collective.abandon()
        collective.form(generation)
    group.allreduce([torch.ones(3)]).wait()
    released = collective.wait_released(20.0) if wait else True
    rank.meet("finished", rank.connect())
    return released


@pytest.mark.timeout(180)
def test_a_rank_torn_down_before_it_finished_never_aborts_as_its_peer_exits() -> None:
    """Every abandoned group is torn down (``wait_released`` is True) before a rank reports
    itself finished, and no rank aborts as its peer exits. Without a "finished" barrier a
    peer exiting while this process was in an abandoned group's destructor aborted it
    ("Resource deadlock avoided", 2 of 8 runs); with the barrier alone 24 of 24 runs passed
    here too, so this pins the order ``Session.close`` keeps, not a failure seen with it."""
    for _ in range(8):
        assert on_ranks(_reform_finish_and_return, True, await_teardowns=False) == [True, True]
