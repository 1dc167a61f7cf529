"""Frame codec (unit, over socketpairs) and FrameServer/FrameClient over loopback TCP
(integration): round trips, size limits, authentication, fencing, truncation, no leaks."""
from __future__ import annotations

import json
import mmap
import os
import socket
import struct
import threading
import time
import tracemalloc

import pytest

from phalanx.configs.errors import PeerUnreachable, SnapshotNotFound
from phalanx.runtime.transport.tcp import (MAX_HEADER_BYTES, FrameClient, FrameInvalid, FrameServer,
                                           IncomingPayload, PeerRefused, Reply, Request,
                                           recv_header, send_frame)

SECRET = b"s" * 32
JOB = "job-t"


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    a.settimeout(5.0)
    b.settimeout(5.0)
    yield a, b
    a.close()
    b.close()


def _echo(request: Request) -> Reply:
    """Echo the header and payload; ``fail`` raises SnapshotNotFound."""
    if request.header.get("op") == "fail":
        raise SnapshotNotFound("rank 3 step 9 is nowhere")
    data = request.payload.read()
    return Reply({"echo": request.header.get("value"), "role": request.peer.role,
                  "generation": request.peer.generation}, data if data else None)


@pytest.fixture
def server():
    with FrameServer("127.0.0.1", 0, secret=SECRET, job=JOB, handler=_echo,
                     generation_check=lambda g: g >= 3, timeout_s=5.0, name="t") as srv:
        yield srv


def _client(srv: FrameServer, **kw) -> FrameClient:
    host, port = srv.address
    args = {"secret": SECRET, "job": JOB, "role": "worker", "timeout_s": 5.0, "generation": 3}
    args.update(kw)
    return FrameClient(host, port, args.pop("secret"), args.pop("job"), args.pop("role"),
                       args.pop("timeout_s"), **args)


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_frame_round_trip_from_parts_into_mmap(pair):
    a, b = pair
    first, second = os.urandom(1000), memoryview(bytearray(os.urandom(3 << 20)))
    sender = threading.Thread(target=send_frame, args=(a, {"op": "x", "k": [1, "é"]},
                                                       [first, second]),
                              kwargs={"where": "a", "chunk_bytes": 64 << 10})
    sender.start()
    header = recv_header(b, where="b", max_payload=1 << 30)
    assert header == {"op": "x", "k": [1, "é"], "nbytes": 1000 + (3 << 20)}
    incoming = IncomingPayload(b, header["nbytes"], "b", chunk_bytes=64 << 10)
    assert bytes(incoming.read(1000)) == first
    dest = mmap.mmap(-1, 4 << 20)
    with memoryview(dest)[: 3 << 20] as view:
        incoming.recv_into(view)
    sender.join(5)
    assert incoming.remaining == 0 and dest[: 3 << 20] == second.tobytes()
    dest.close()


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_oversize_header_refused_before_allocation(pair):
    a, b = pair
    a.sendall(struct.pack(">I", (1 << 31) + 7))  # claims 2 GiB, sends nothing more
    tracemalloc.start()
    started = time.monotonic()
    with pytest.raises(FrameInvalid, match="exceeds"):
        recv_header(b, where="b", max_payload=1 << 30)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < MAX_HEADER_BYTES and time.monotonic() - started < 1.0


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_oversize_payload_and_bad_headers_refused(pair):
    a, b = pair
    for header, match in ((b'{"nbytes": 4097}', "exceeds the limit"),
                          (b'[1, 2]', "not an object"), (b'\xff\xfe{}', "not UTF-8"),
                          (b'{"nbytes": -1}', "non-negative"),
                          (b"[" * 100_000, "not UTF-8 JSON")):
        a.sendall(struct.pack(">I", len(header)) + header)
        with pytest.raises(FrameInvalid, match=match):
            recv_header(b, where="b", max_payload=4096)
    with pytest.raises(FrameInvalid, match="exceeds"):
        send_frame(a, {"blob": "x" * MAX_HEADER_BYTES}, where="a")


@pytest.mark.unit
@pytest.mark.timeout(10)
def test_truncated_frames_raise_instead_of_hanging(pair):
    a, b = pair
    body = json.dumps({"op": "x", "nbytes": 100}).encode()
    a.sendall(struct.pack(">I", len(body)) + body + b"only-20-bytes-sent..")
    a.shutdown(socket.SHUT_WR)
    header = recv_header(b, where="b", max_payload=1000)
    with pytest.raises(PeerUnreachable, match="after 20 of 100 bytes"):
        IncomingPayload(b, header["nbytes"], "b").read()
    c, d = socket.socketpair()
    d.settimeout(5.0)
    c.sendall(struct.pack(">I", 50) + b'{"op"')
    c.close()
    with pytest.raises(PeerUnreachable, match="closed during recv header"):
        recv_header(d, where="d", max_payload=10)
    d.close()


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_request_round_trip_and_request_into(server):
    assert server.address[0] == "127.0.0.1"
    payload = os.urandom(5 << 20)
    with _client(server) as client:
        header, data = client.request({"op": "echo", "value": 7}, [payload[:10], payload[10:]])
        assert (header["ok"], header["echo"], header["role"], header["generation"]) == \
            (True, 7, "worker", 3)
        assert data == payload
        dest = mmap.mmap(-1, 8 << 20)
        reply = client.request_into({"op": "echo"}, dest, memoryview(payload))
        assert reply["nbytes"] == len(payload) and dest[: len(payload)] == payload
        dest.close()  # no view of it survives request_into
        assert client.request({"op": "echo", "value": None})[1] is None
        with pytest.raises(FrameInvalid, match="does not fit"):
            client.request_into({"op": "echo"}, bytearray(10), payload[:11])
        assert client.request({"op": "echo", "value": 1})[0]["echo"] == 1  # reconnected


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_remote_errors_keep_their_class_and_the_connection(server):
    with _client(server) as client:
        with pytest.raises(SnapshotNotFound, match="rank 3 step 9"):
            client.request({"op": "fail"}, b"ignored payload is drained")
        assert client.request({"op": "echo", "value": 2})[0]["echo"] == 2


@pytest.mark.integration
@pytest.mark.timeout(20)
@pytest.mark.parametrize("kw,code", [({"secret": b"wrong" * 8}, "auth"),
                                     ({"job": "other-job"}, "job"),
                                     ({"generation": 2}, "generation")])
def test_handshake_refusals(server, kw, code):
    with _client(server, **kw) as client:
        with pytest.raises(PeerRefused) as info:
            client.request({"op": "echo"})
    assert info.value.code == code and f"{server.address[1]}" in str(info.value)


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_client_refuses_server_without_the_secret():
    with FrameServer("127.0.0.1", secret=b"x" * 32, job=JOB, handler=_echo) as rogue:
        # The rogue server refuses us first (auth); a client always learns of a mismatch.
        with _client(rogue) as client, pytest.raises(PeerRefused):
            client.connect()
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.settimeout(5.0)

    def fake_server() -> None:
        conn, _ = lsock.accept()
        conn.settimeout(5.0)
        send_frame(conn, {"op": "hello", "ok": True, "proto": 1, "nonce": "00" * 32}, where="f")
        recv_header(conn, where="f", max_payload=0)
        send_frame(conn, {"ok": True, "mac": "11" * 32}, where="f")  # a guess, not a proof
        conn.close()

    thread = threading.Thread(target=fake_server)
    thread.start()
    client = FrameClient("127.0.0.1", lsock.getsockname()[1], SECRET, JOB, "worker", 5.0)
    with pytest.raises(PeerRefused) as info:
        client.connect()
    assert info.value.code == "server-auth"
    thread.join(5)
    lsock.close()


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_server_refuses_oversize_payload_before_reading_it():
    with FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=_echo,
                     max_payload=1 << 20) as srv, _client(srv, generation=0) as client:
        with pytest.raises((FrameInvalid, PeerUnreachable)):
            client.request({"op": "echo"}, bytes((1 << 20) + 1))
        assert client.request({"op": "echo", "value": 5})[0]["echo"] == 5


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_unreachable_and_busy():
    probe = socket.create_server(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    with pytest.raises(PeerUnreachable, match=f"127.0.0.1:{port}: connect"):
        FrameClient("127.0.0.1", port, SECRET, JOB, "worker", 2.0).connect()
    with FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=_echo,
                     max_connections=1) as srv:
        with _client(srv) as first, _client(srv) as second:
            first.connect()
            with pytest.raises(PeerUnreachable, match="busy|holds 1 connections"):
                second.connect()


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_close_joins_threads_and_releases_the_port():
    before = {t.ident for t in threading.enumerate()}
    srv = FrameServer("127.0.0.1", secret=SECRET, job=JOB, handler=_echo, name="leak")
    srv.start()
    clients = [_client(srv, generation=0) for _ in range(3)]
    for client in clients:
        client.request({"op": "echo"})  # idle, connected clients at close()
    started = time.monotonic()
    srv.close()
    assert time.monotonic() - started < 2.0
    assert [t.name for t in threading.enumerate() if t.ident not in before] == []
    with pytest.raises(PeerUnreachable):
        clients[0].request({"op": "echo"})
    for client in clients:
        client.close()
    with pytest.raises(PeerUnreachable, match="connect"):
        FrameClient(*srv.address, SECRET, JOB, "worker", 2.0).connect()


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_a_sent_frame_is_handled_and_its_reply_collected_later_or_before_the_next_request(server):
    with _client(server) as client:
        assert client.collect() is None                   # nothing sent
        client.send({"op": "echo", "value": 4}, b"x")
        assert client.collect()["echo"] == 4
        assert client.collect() is None                   # read once
        client.send({"op": "echo", "value": 5})
        # a request reads the reply still owed first, so its own reply is the one returned
        assert client.request({"op": "echo", "value": 6})[0]["echo"] == 6
        assert client.collect()["echo"] == 5
        client.send({"op": "fail"})
        client.send({"op": "echo", "value": 7})          # the failed reply is read, then lost
        assert client.collect()["echo"] == 7
        client.send({"op": "fail"})
        with pytest.raises(SnapshotNotFound, match="rank 3 step 9"):
            client.collect()
        assert client.request({"op": "echo", "value": 8})[0]["echo"] == 8   # stream whole


@pytest.mark.integration
@pytest.mark.timeout(20)
def test_a_reply_lost_with_its_connection_is_a_peer_unreachable_at_collect():
    with FrameServer("127.0.0.1", 0, secret=SECRET, job=JOB, handler=_echo,
                     generation_check=lambda g: g >= 3, timeout_s=5.0, name="t") as srv:
        client = _client(srv)
        client.send({"op": "echo", "value": 1})
        client.close()
        with pytest.raises(PeerUnreachable, match="before the reply to op=echo"):
            client.collect()
