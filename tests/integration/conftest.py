"""Fixtures shared by the integration tests of the process groups."""
from __future__ import annotations

import datetime
from typing import Callable

import pytest
import torch.distributed as dist


@pytest.fixture
def store() -> Callable[[], dist.Store]:
    """What the session passes: a function opening a new client of the job's TCPStore."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))

    def connect() -> dist.Store:
        return dist.TCPStore("127.0.0.1", master.port, is_master=False,
                             timeout=datetime.timedelta(seconds=30))
    connect.master = master  # type: ignore[attr-defined]   # kept alive with the fixture
    return connect
