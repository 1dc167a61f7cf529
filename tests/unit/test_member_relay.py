"""The rank's side of the per-node lease (``MemberRelay``): on its own lease while its
keeper is gone, back to the keeper once one publishes its record, and still on its own lease
(never unlisted, never crashing) when the keeper is lost again while the record moves. The
keeper is a stand-in for ``KeeperClient``'s two member ops; etcd is the in-memory fake."""
from __future__ import annotations

from phalanx.configs.errors import PeerUnreachable
from phalanx.runtime.base import MEMBERS, MemberRecord
from phalanx.runtime.worker.member_relay import RETRY_S, MemberRelay
from tests.fakes.membership_memory import InMemoryMembership


class Keeper:
    """``member_beat`` answers ``published`` as told, or raises while ``up`` is False."""

    def __init__(self) -> None:
        self.up, self.published, self.beats = True, False, 0

    def member_beat(self, worker_id: str, record: bytes | None, ttl_s: float,
                    join: bool = False, urgent: bool = False) -> dict[str, bool]:
        self.beats += 1
        if not self.up:
            raise PeerUnreachable("keeper gone")
        return {"known": True, "published": self.published}

    def member_leave(self, worker_id: str) -> None:
        pass

    def close(self) -> None:
        pass


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_keeper_lost_again_while_the_record_moves_back_leaves_it_on_the_own_lease() -> None:
    keeper, clock, etcd = Keeper(), Clock(), InMemoryMembership()
    relay = MemberRelay(etcd, "w0", lambda: keeper if keeper.up else None, clock)
    relay._closing.set()             # noqa: SLF001  (no keepalive thread: beats by hand)
    record = MemberRecord("w0", 0, "node0", step=1)
    relay.join(record, 3.0)
    assert relay.via_keeper and etcd.get(MEMBERS + "w0") is None

    keeper.up = False
    relay.touch()                                     # the keeper is gone: own lease
    assert not relay.via_keeper and etcd.get(MEMBERS + "w0") is not None

    keeper.up = True
    clock.now += RETRY_S
    relay.touch()                                     # handed back, not yet published
    assert not relay.via_keeper and etcd.get(MEMBERS + "w0") is not None
    keeper.up = False
    relay.touch()                                     # lost again while moving
    relay.touch()
    assert not relay.via_keeper and etcd.get(MEMBERS + "w0") is not None
    relay.update(MemberRecord("w0", 0, "node0", step=2))
    assert etcd.members()["w0"].step == 2             # written under its own lease

    keeper.up, keeper.published = True, True
    clock.now += RETRY_S
    relay.touch()                                     # handed back
    relay.touch()                                     # published: own lease revoked
    assert relay.via_keeper and etcd.get(MEMBERS + "w0") is None
    relay.close()
