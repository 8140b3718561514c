"""The all-gather streams (trimlab.agents.stream): three ranks on loopback addresses connect
(lower ranks connected to, higher ones accepted), messages arrive whole and in order with
their (step, shard) and SENT marks between them are kept apart, a connection of another
job or from no rank's address is refused and counted (one that connects and says nothing
never holds up the others), and ending the streams reads every peer's end."""

import collections
import select
import socket

import pytest

from trimlab.agents.failure import ProtocolError
from trimlab.agents.stream import HELLO, STREAM_VERSION, Mesh

PORT = 47123
ADDRS = {0: "127.0.61.1", 1: "127.0.61.2", 2: "127.0.61.3"}


def _pump(meshes, until, rounds=10_000):
    for _ in range(rounds):
        if until():
            return
        reads, writes = [], []
        for m in meshes:
            r, w = m.sockets()
            reads += r
            writes += w
        ready, writable, _ = select.select(reads, writes, [], 1.0)
        for m in meshes:
            m.progress(ready, writable)
    raise AssertionError("the streams did not get there")


@pytest.fixture
def meshes():
    made = [Mesh(7, r, ADDRS, PORT, 46, False, str, {}, collections.Counter()) for r in ADDRS]
    yield made
    for m in made:
        m.close()


@pytest.mark.unit
def test_three_ranks_exchange_whole_messages_in_order(meshes):
    for m in meshes:
        m.connect(5.0)
    _pump(meshes, lambda: all(m.connected for m in meshes))
    big = bytes(range(256)) * 4096  # 1 MiB: many reads and writes
    for m in meshes:
        for r in ADDRS:
            if r != m.rank:
                m.send(r, 3, 10 + m.rank, big[:1000 * (m.rank + 1)])
                m.mark_sent(r, 3, 5)
                m.send(r, 3, 20 + m.rank, big)
                m.mark_sent(r, 4, 2)  # between messages: never taken for one, never stored
                m.mark_sent(r, 3, 9)  # an older mark does not move it back
                m.send(r, 4, 0, b"")
    _pump(meshes, lambda: all(len(m.received) == 6 for m in meshes))
    for m in meshes:
        for r, a in m.addrs.items():
            assert m.received[(a, 3, 10 + r)] == big[:1000 * (r + 1)]
            assert m.received[(a, 3, 20 + r)] == big
            assert m.received[(a, 4, 0)] == b""
            assert m.sent_to_us[a] == (4, 2)
    for m in meshes:
        m.end()
    _pump(meshes, lambda: all(m.all_ended() for m in meshes))


@pytest.mark.unit
def test_a_connection_of_another_job_or_address_is_refused(meshes):
    top = meshes[2]
    for bad_hello, src in ((HELLO.pack(STREAM_VERSION, 8, 2), ADDRS[2]),  # another job
                           (HELLO.pack(STREAM_VERSION, 7, 2), "127.0.61.9")):  # no rank's address
        s = socket.socket()
        s.bind((src, 0))
        s.connect((ADDRS[1], PORT))
        s.sendall(bad_hello)
        _pump([meshes[1]], lambda: meshes[1].discarded["stream_unknown"] == (1 if src == ADDRS[2] else 2))
        s.close()
    assert 2 not in meshes[1].peers
    silent = socket.socket()  # connects and says nothing: waits in its own HELLO state,
    silent.bind((ADDRS[2], 0))  # never in the way of the pump
    silent.connect((ADDRS[1], PORT))
    _pump([meshes[1]], lambda: len(meshes[1].hello) == 1)
    top.connect(5.0)  # the real rank 2 still gets in
    _pump([meshes[1], top], lambda: 2 in meshes[1].peers)
    silent.close()  # and when the silent one leaves, it is counted
    _pump([meshes[1]], lambda: meshes[1].discarded["stream_unknown"] == 3 and not meshes[1].hello)


@pytest.mark.unit
def test_a_rank_that_never_listens_is_a_clear_error():
    alone = Mesh(7, 1, {0: "127.0.61.7", 1: "127.0.61.8"}, PORT + 1, 46, False, str, {}, collections.Counter())
    try:
        with pytest.raises(ProtocolError, match="cannot connect the all-gather stream to 127.0.61.7"):
            alone.connect(0.3)
    finally:
        alone.close()
