"""One logging configuration (``phalanx.runtime.logs``): logfmt and JSON lines, the rank and
the live generation on every worker record, quoting, messages never cut (at either end),
and steps redone after a rollback marked ``replay=true``."""
from __future__ import annotations

import io
import json
import logging
from typing import Iterator

import pytest
import torch
from rich.console import Console

from phalanx.launcher.progress import ProgressView
from phalanx.runtime.base import MemberRecord
from phalanx.runtime.context import WorkerContext
from phalanx.runtime import logs
from phalanx.runtime.group.collective import _whole
from phalanx.runtime.logs import (ReplayMarker, bind_fields, bound_fields, configure_logging,
                                  current_format, logging_configured, quote, split_message)
from phalanx.runtime.worker.session import Session

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]
log = logging.getLogger("phalanx.test_logs")


@pytest.fixture
def capture(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    """Root logging into a buffer; the process's handlers, level, format and bound fields
    are put back afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    monkeypatch.setattr(logs, "_format", current_format())
    yield io.StringIO()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)
    bind_fields(**{name: None for name in bound_fields()})


def lines(buffer: io.StringIO) -> list[str]:
    return buffer.getvalue().splitlines()


def test_a_logfmt_line_carries_time_level_logger_rank_and_generation(
        capture: io.StringIO) -> None:
    configure_logging("logfmt", logging.INFO, capture)
    generation = {"now": 2}
    bind_fields(rank=3, generation=lambda: generation["now"])
    log.info("event=plan_received step=%d source=%s", 7, "replica")
    generation["now"] = 5                       # a recovery moved the process on
    log.warning("event=collective_aborted reason=%r", "peer [1] closed")
    first, second = lines(capture)
    assert first.startswith("ts=") and first.split()[0].endswith("Z")
    assert " level=info logger=phalanx.test_logs rank=3 generation=2 " in first
    assert first.endswith("event=plan_received step=7 source=replica")
    assert " level=warning " in second and " rank=3 generation=5 " in second
    assert second.endswith("event=collective_aborted reason='peer [1] closed'")


def test_a_field_the_message_names_is_not_repeated(capture: io.StringIO) -> None:
    configure_logging("logfmt", logging.INFO, capture)
    bind_fields(rank=1, generation=4)
    log.info("event=session_start rank=%d generation=%d", 1, 4)
    (line,) = lines(capture)
    assert line.count("rank=") == 1 and line.count("generation=") == 1


def test_json_lines_hold_the_fields_and_the_whole_message(capture: io.StringIO) -> None:
    configure_logging("json", logging.INFO, capture)
    bind_fields(rank=0, generation=3)
    log.info("event=rank_restored rank=%d step=%d source=%r seconds=%.3f", 0, 12, "own", 0.25)
    log.info("tier_commit tier=disk step=%d", 20)
    log.error("worker said: %s", "no key=value here\nsecond line")
    restored, commit, free = (json.loads(line) for line in lines(capture))
    assert restored["level"] == "info" and restored["logger"] == "phalanx.test_logs"
    assert restored["ts"].endswith("Z") and restored["generation"] == 3
    assert (restored["event"], restored["rank"], restored["step"], restored["source"],
            restored["seconds"]) == ("rank_restored", 0, 12, "own", 0.25)
    assert restored["msg"] == "event=rank_restored rank=0 step=12 source='own' seconds=0.250"
    assert commit["event"] == "tier_commit" and commit["tier"] == "disk"
    assert free["msg"] == "worker said: no key=value here\nsecond line" and free["rank"] == 0


def test_values_are_quoted_when_they_must_be_and_lines_stay_single(
        capture: io.StringIO) -> None:
    assert quote("replica") == "replica" and quote(7) == "7" and quote(True) == "true"
    assert quote("a b") == '"a b"' and quote("") == '""' and quote("k=v") == '"k=v"'
    assert quote('say "hi"') == '"say \\"hi\\""' and quote("two\nlines") == '"two\\nlines"'
    configure_logging("logfmt", logging.INFO, capture)
    log.info("free text, [brackets] and \"quotes\"\nand a second line")
    log.info("event=x", extra={"path": "/tmp/a dir/f"})
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("event=failed")
    text, extra, failed = lines(capture)
    assert text.endswith('msg="free text, [brackets] and \\"quotes\\"\\nand a second line"')
    assert ' path="/tmp/a dir/f" event=x' in extra
    assert failed.startswith("ts=") and ' exc="Traceback (most recent call last):\\n' in failed
    assert failed.endswith('ValueError: boom"')


def test_a_10kb_message_is_never_cut(capture: io.StringIO) -> None:
    payload = "".join(f"{i:05d} " for i in range(1700))    # 10.2 kB, words with spaces
    configure_logging("logfmt", logging.INFO, capture)
    log.warning("event=big detail=%s", payload.replace(" ", "-"))
    log.warning("worker output: %s", payload)
    structured, free = lines(capture)
    assert structured.endswith("detail=" + payload.replace(" ", "-"))
    assert free.endswith(f'msg="worker output: {payload}"')
    capture.truncate(0)
    capture.seek(0)
    configure_logging("json", logging.INFO, capture)
    log.warning("worker output: %s", payload)
    assert json.loads(lines(capture)[0])["msg"] == f"worker output: {payload}"


def test_a_collective_error_keeps_its_front_and_its_cause() -> None:
    """gloo's cause sits at the end of a long first line: it was cut from the front."""
    long = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] " + "x" * 400
            + " Connection closed by peer [127.0.0.1]:29500")
    error = RuntimeError(long + "\nException raised from recv at ../pair.cc:534\nframe #0: f()")
    assert _whole(error) == long


def test_split_message_reads_phalanx_messages() -> None:
    assert split_message("event=x rank=1 reason='a b'") == (
        {"event": "x", "rank": 1, "reason": "a b"}, True)
    assert split_message("keeper.started node=n0 slots=3") == (
        {"event": "keeper.started", "node": "n0", "slots": 3}, True)
    fields, whole = split_message("event=ray_start_retry error=local Ray did not start")
    assert fields == {"event": "ray_start_retry"} and not whole   # 'error' is cut short
    assert split_message("plain words") == ({}, False)


def test_replay_marker_marks_steps_at_or_below_the_highest() -> None:
    marker = ReplayMarker()
    assert [marker.mark(s) for s in (0, 1, 2, 3, 2, 3, 4, 5)] == [
        False, False, False, False, True, True, False, False]
    assert ReplayMarker(highest=9).mark(9) and not ReplayMarker(highest=9).mark(10)


def test_a_worker_session_logs_rank_generation_and_replayed_steps(
        capture: io.StringIO) -> None:
    configure_logging("logfmt", logging.DEBUG, capture)
    ctx = WorkerContext(job="logs", rank=3, world_size=4, generation=2,
                        torch_threads=torch.get_num_threads())
    session = Session(ctx, capture_rng=False)
    with session:
        for _ in range(3):
            with session.step():
                pass
        session._progress.step_index = 1   # what a rollback's restore does to the session
        session.generation = 6             # ... in the plan's generation
        while session.step_index < 4:
            with session.step():
                pass
        log.info("event=from_user_code")
    done = [line for line in lines(capture) if "event=step_done" in line]
    assert len(done) == 6 and all(" rank=3 " in line for line in done)
    assert [("replay=true" in line) for line in done] == [False, False, False, True, True,
                                                          False]
    assert all(" generation=2 " in line for line in done[:3])
    assert all(" generation=6 " in line for line in done[3:])
    assert " level=info " in done[3] and " level=debug " in done[5]
    assert "step=1 " in done[3] and "step=2 " in done[4] and "step=3 " in done[5]
    user = [line for line in lines(capture) if "event=from_user_code" in line]
    assert user and " rank=3 generation=6 " in user[0]


def test_progress_marks_ranks_that_replay_steps() -> None:
    out = io.StringIO()
    view = ProgressView(Console(file=out, width=200), 2, 10, plain_every_s=0.0)

    def members(step0: int, step1: int) -> dict[str, MemberRecord]:
        return {f"w{r}": MemberRecord(f"w{r}", r, f"node{r}", step=s, extra={"state": "running"})
                for r, s in ((0, step0), (1, step1))}

    view.update(members(5, 5), now=1.0)
    view.update(members(3, 3), now=2.0)      # rolled back to step 3
    view.update(members(6, 6), now=3.0)      # past the highest again
    first, rolled_back, past = out.getvalue().splitlines()
    assert "replay" not in first and "replay" not in past
    assert rolled_back.endswith("replay=true ranks=0,1")


def test_the_format_reaches_workers_and_a_cli_run_leaves_logging_as_it_was(
        capture: io.StringIO) -> None:
    root = logging.getLogger()
    before, fmt = list(root.handlers), current_format()
    with logging_configured("json", logging.INFO, capture):
        assert current_format() == "json"
        ctx = WorkerContext(job="logs", rank=1, world_size=2, log_format=current_format())
        assert WorkerContext.from_env(ctx.to_env()).log_format == "json"
        log.info("event=inside")
    assert root.handlers == before and current_format() == fmt
    log.info("event=outside")
    assert [json.loads(line)["event"] for line in lines(capture)] == ["inside"]
    with pytest.raises(ValueError, match="logfmt, json"):
        configure_logging("xml")
