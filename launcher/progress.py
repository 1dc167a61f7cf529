"""Live job progress for the terminal: per-rank step, steps/s and state, read from the etcd
member table (rich table when attached to a terminal, a plain line every few seconds when not).
A rank below the highest step it reported is redoing steps after a rollback: marked replay."""
from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from phalanx.runtime.base import MemberRecord


@dataclass
class RankRow:
    node: str = "?"
    step: int = -1
    state: str = "starting"
    rate: float = 0.0
    samples: list[tuple[float, int]] = field(default_factory=list)
    highest: int = -1            # the furthest step reported: below it, steps are replays

    @property
    def replaying(self) -> bool:
        return 0 <= self.step < self.highest


class ProgressView:
    """Owned by the launcher's main thread; ``update()`` after each poll, ``close()`` at the end."""

    def __init__(self, console: Console, world_size: int, total_steps: int | None,
                 plain_every_s: float = 5.0) -> None:
        self._console = console
        self._rows = {rank: RankRow() for rank in range(world_size)}
        self._total = total_steps
        self._plain_every_s = plain_every_s
        self._last_plain = 0.0
        self._live: Live | None = None
        self._started = time.monotonic()

    def start(self) -> "ProgressView":
        if self._console.is_terminal:
            self._live = Live(self._table(), console=self._console, refresh_per_second=4,
                              transient=False)
            self._live.start()
        return self

    def update(self, members: Mapping[str, MemberRecord], now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        for record in members.values():
            row = self._rows.get(record.rank)
            if row is None:
                continue
            row.node = record.node
            row.state = str(record.extra.get("state", "running"))
            if record.step != row.step:
                row.step = record.step
                row.highest = max(row.highest, record.step)
                row.samples = [s for s in row.samples if now - s[0] < 5.0] + [(now, record.step)]
                first = row.samples[0]
                row.rate = (record.step - first[1]) / (now - first[0]) if now > first[0] else 0.0
        if self._live is not None:
            self._live.update(self._table())
        elif now - self._last_plain >= self._plain_every_s:
            self._last_plain = now
            self._console.print(self._plain_line(now), markup=False, highlight=False)

    def mark(self, rank: int, state: str) -> None:
        if rank in self._rows:
            self._rows[rank].state = state

    def close(self) -> None:
        if self._live is not None:
            self._live.update(self._table())
            self._live.stop()
            self._live = None

    def _plain_line(self, now: float) -> str:
        steps = [row.step for row in self._rows.values()]
        if max(steps) < 0:      # before any Session's first step, or a script without one
            return f"[{now - self._started:6.1f}s] no step reported yet (session.step() counts)"
        total = f"/{self._total}" if self._total else ""
        replays = [str(rank) for rank, row in sorted(self._rows.items()) if row.replaying]
        return (f"[{now - self._started:6.1f}s] steps {min(steps)}..{max(steps)}{total} "
                f"rate {sum(r.rate for r in self._rows.values()) / max(1, len(self._rows)):.1f}"
                f" steps/s  states " + ",".join(sorted({r.state for r in self._rows.values()}))
                + (f"  replay=true ranks={','.join(replays)}" if replays else ""))

    def _table(self) -> Table:
        title = f"phalanx: {len(self._rows)} ranks"
        if self._total:
            title += f", {self._total} steps"
        table = Table(title=title)
        for column in ("rank", "node", "step", "steps/s", "state"):
            table.add_column(column)
        for rank, row in sorted(self._rows.items()):
            total = f"/{self._total}" if self._total else ""
            table.add_row(str(rank), escape(row.node), f"{max(row.step, 0)}{total}",
                          f"{row.rate:.1f}", escape(row.state) + (
                              f" (replay to {row.highest})" if row.replaying else ""))
        return table
