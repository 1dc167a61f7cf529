"""The generation watcher tells its subscribers when a newer generation is announced (the
default group completes a superseded generation's collectives then, with no thread polling
for it), once per newer value, never for an older or repeated one."""
from __future__ import annotations

import threading

from phalanx.runtime.membership.generation import GENERATION_KEY, GenerationWatcher
from tests.fakes.membership_memory import InMemoryMembership
from tests.polling import eventually


def test_subscribers_hear_each_newer_generation_once() -> None:
    membership = InMemoryMembership()
    membership.put(GENERATION_KEY, b"2")
    watcher = GenerationWatcher(membership)
    heard: list[int] = []
    lock = threading.Lock()

    def listener() -> None:
        with lock:
            heard.append(watcher.latest)

    watcher.subscribe(listener)
    watcher.start()
    try:
        assert eventually(lambda: heard == [2], within_s=5)   # the value found at start
        membership.put(GENERATION_KEY, b"3")
        assert eventually(lambda: heard == [2, 3], within_s=5)
        membership.put(GENERATION_KEY, b"3")                  # the same again: nothing
        membership.put(GENERATION_KEY, b"1")                  # older: nothing
        membership.put(GENERATION_KEY, b"5")
        assert eventually(lambda: heard == [2, 3, 5], within_s=5)
        assert watcher.newer_than(4) and not watcher.newer_than(5)
    finally:
        watcher.close()
