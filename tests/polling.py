"""Real-time polling for effects delivered on another thread or process (etcd watches, a
keeper's reporter): shared by the tests that wait for them."""
from __future__ import annotations

import time
from typing import Callable


def eventually(predicate: Callable[[], bool], within_s: float = 2.0,
               every_s: float = 0.01) -> bool:
    """Whether ``predicate()`` held within ``within_s``, asked every ``every_s``."""
    deadline = time.monotonic() + within_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True
