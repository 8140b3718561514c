"""agents.transport on loopback: DSCP marking and the TOS seen on receive, IPv4 and IPv6,
batched receive, pacing, sequence numbers."""

import json
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from trimlab import wire
from trimlab.agents import transport
from trimlab.codec import get_codec
from trimlab.agents.transport import Receiver, Sender, tos_byte


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_dscp_and_ecn_arrive_with_every_datagram(addr):
    rx = Receiver(addr, 0)
    tx = Sender(addr, rx.port, dscp=10, ecn=1)
    tx.send_all(struct.pack("!I", i) + b"x" * 100 for i in range(50))
    got = []
    deadline = time.monotonic() + 5
    while len(got) < 50 and time.monotonic() < deadline:
        got += rx.recv_batch(timeout=0.5)
    assert [struct.unpack_from("!I", d.payload)[0] for d in got] == list(range(50))
    assert {d.tos for d in got} == {tos_byte(10, 1)} and {d.dscp for d in got} == {10}
    tx.close()
    rx.close()


def test_batches_drain_what_is_queued_and_wait_only_for_the_first():
    rx = Receiver("127.0.0.1", 0)
    tx = Sender("127.0.0.1", rx.port)
    for i in range(150):  # well inside the default receive buffer ceiling
        tx.send(struct.pack("!I", i))  # loopback delivers within sendto: all queued now
    assert len(rx.recv_batch(max_packets=100)) == 100
    assert len(rx.recv_batch(max_packets=100)) == 50
    t0 = time.monotonic()
    assert rx.recv_batch(timeout=0.2) == []
    assert time.monotonic() - t0 >= 0.15  # it waited (no upper bound: a loaded machine is slow)


def test_pacing_holds_the_rate():
    rx = Receiver("127.0.0.1", 0)
    t0 = time.perf_counter()  # before the sender: its schedule starts at its construction
    tx = Sender("127.0.0.1", rx.port, rate_bps=8_000_000)  # 1 MB/s
    tx.send_all(b"\0" * 1000 for _ in range(200))  # 200 kB: the last leaves ≥ 199 ms after the first
    assert time.perf_counter() - t0 >= 0.199  # paced: never faster (no upper bound: load only slows it)


class OversleepingClock:
    """A clock whose sleeps last `factor` times what was asked, plus `extra` seconds: a
    process on a busy host."""

    def __init__(self, factor=3.0, extra=0.002):
        self.now, self.factor, self.extra = 100.0, factor, extra

    def __call__(self):
        return self.now

    def sleep(self, s):
        self.now += s * self.factor + self.extra


@pytest.mark.parametrize("factor,extra", [(1.0, 0.0), (3.0, 0.002), (1.0, 0.004)])
def test_a_pacer_that_oversleeps_still_delivers_its_rate(factor, extra):
    """19 Mbit/s of 1 000-byte datagrams for 2 s of the clock: the old pacer (schedule from
    `now` after each sleep) delivered 1/factor of the rate, or less with a late wake-up;
    this one makes up what it overslept, so the bytes sent by any time are those due."""
    from trimlab.agents.transport import Pacer
    clock = OversleepingClock(factor, extra)
    pacer = Pacer(19e6, burst_bytes=int(19e6 * 0.02 / 8), clock=clock, sleep=clock.sleep)  # as traffic's flows
    start, sent = clock(), 0
    while clock() - start < 2.0:
        pacer.wait(1000)
        sent += 1000
    delivered = sent * 8 / (clock() - start)
    assert 0.99 * 19e6 <= delivered <= 19e6 * 1.01 + 1000 * 8 / 2.0
    assert pacer.forgotten_s == 0


def test_a_pacer_never_bursts_more_than_its_bound():
    """A sender stalled for a second sends at most the bound back to back (the packet due
    now and `burst_bytes` behind it), and counts the time it gave up. Binary fractions of a
    second keep the clock's arithmetic exact."""
    from trimlab.agents.transport import Pacer
    clock = OversleepingClock(1.0, 0.0)
    pacer = Pacer(8 * 1024 * 1024, burst_bytes=10 * 1024, clock=clock, sleep=clock.sleep)  # 1 KiB: 1/1024 s
    pacer.wait(1024)
    clock.now += 1.0  # stalled
    t, burst = clock(), 0
    while True:
        pacer.wait(1024)
        if clock() != t:
            break
        burst += 1
    assert burst == 11
    assert pacer.forgotten_s == 1.0 - 1 / 1024 - 10 / 1024
    assert Pacer(8e6).lag == 2 * 1500 * 8 / 8e6  # by default two full datagrams
    with pytest.raises(ValueError, match="must be positive"):
        Pacer(0)


def test_bad_values():
    with pytest.raises(ValueError, match="dscp=64"):
        tos_byte(64)


def test_command_line_send_and_receive():
    rx = subprocess.Popen([sys.executable, "-m", "trimlab.agents.transport", "recv", "--bind", "127.0.0.1",
                           "--port", "47999", "--idle", "1"], stdout=subprocess.PIPE, text=True)
    assert json.loads(rx.stdout.readline()) == {"listening": 47999}  # bound: send now
    tx = subprocess.run([sys.executable, "-m", "trimlab.agents.transport", "send", "--dst", "127.0.0.1",
                         "--port", "47999", "--dscp", "46", "--count", "20", "--size", "64"],
                        capture_output=True, text=True, check=True)
    assert json.loads(tx.stdout)["sent"] == 20
    lines = [json.loads(x) for x in rx.communicate(timeout=20)[0].splitlines()]
    assert [x["seq"] for x in lines] == list(range(20)) and {x["dscp"] for x in lines} == {46}
    helptext = subprocess.run([sys.executable, "-m", "trimlab.agents.transport", "--help"], capture_output=True, text=True)
    assert helptext.returncode == 0 and "send" in helptext.stdout


def count_sendmmsg(monkeypatch) -> list[int]:
    """The messages of every sendmmsg call the transport makes fill the list."""
    calls, real = [], transport._LIBC

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def sendmmsg(self, fd, msgs, vlen, flags):
            calls.append(vlen)
            return real.sendmmsg(fd, msgs, vlen, flags)
    monkeypatch.setattr(transport, "_LIBC", Counting())
    return calls


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_unpaced_sends_go_as_gso_runs_and_arrive_as_datagrams(addr, monkeypatch):
    """Runs of equal sizes (at most 64, a shorter datagram ends one) are one GSO message
    each, all of them in one sendmmsg call; every datagram arrives whole, in order, with
    its own DSCP."""
    rx = Receiver(addr, 0)
    tx = Sender(addr, rx.port, dscp=10)
    calls = count_sendmmsg(monkeypatch)
    sizes = [1000] * 100 + [300] + [500] * 70 + [64]
    payloads = [struct.pack("!I", i) + bytes(n - 4) for i, n in enumerate(sizes)]
    tx.send_all(payloads)
    got = []
    deadline = time.monotonic() + 10
    while len(got) < len(payloads) and time.monotonic() < deadline:
        got += rx.recv_batch(timeout=0.5)
    assert [d.payload for d in got] == payloads and {d.dscp for d in got} == {10}
    # 1000 B: 64 + (36 + the 300 B that ends the run); 500 B: 64 + (6 + the 64 B one)
    runs = transport.gso_runs(np.array(sizes))
    assert [(int(r), int(s)) for r, s in zip(runs["rows"], runs["size"])] == [(64, 1000), (37, 1000), (64, 500), (7, 500)]
    assert tx.gso and calls == [4]
    assert tx.sent == len(payloads) and tx.bytes == sum(sizes)
    rx.close()
    tx.close()


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_recv_many_reads_a_batch_as_arrays_with_each_datagrams_tos_and_source(addr):
    """One recvmmsg call: lengths, per-datagram TOS (two senders, two DSCPs), the source
    address and port, and datagrams longer than a slot marked truncated."""
    rx = Receiver(addr, 0, slot=256, batch=8)
    a, b = Sender(addr, rx.port, dscp=10), Sender(addr, rx.port, dscp=46)
    for i in range(6):
        (a if i % 2 else b).send(bytes([i]) * (10 + i))
    a.send(b"z" * 300)  # longer than a slot
    got, deadline = [], time.monotonic() + 30
    while sum(map(len, got)) < 7 and time.monotonic() < deadline:
        batch = rx.recv_many(timeout=1.0)
        if batch is not None:
            got.append(batch)
            assert len(batch) <= 8
    lengths = [int(x) for b in got for x in b.length]
    dscps = [int(x) for b in got for x in b.dscp]
    firsts = [int(b.data[i, 0]) for b in got for i in range(len(b))]
    assert lengths == [10, 11, 12, 13, 14, 15, 256] and firsts == [0, 1, 2, 3, 4, 5, ord("z")]
    assert dscps == [46, 10, 46, 10, 46, 10, 10]
    assert [bool(x) for b in got for x in b.truncated] == [False] * 6 + [True]
    assert {got[0].src(0)} == {addr} and got[0].port[1] == a.sock.getsockname()[1]
    assert rx.recv_many(timeout=0) is None
    for s in (a, b, rx):
        s.close()


@pytest.mark.parametrize("addr", ["127.0.0.1", "::1"])
def test_frames_leave_from_the_array_in_gso_runs(addr, monkeypatch):
    """A bucket's frames (full-width rows back to back, shorter tail rows) leave straight
    from the array, 64 rows to a GSO message, every message in one sendmmsg call; every
    datagram arrives as payloads()."""
    frames = wire.packetize_frames(torch.randn(150_000, generator=torch.Generator().manual_seed(3)),
                                   get_codec("embedded"), coords=352, ids=wire.PacketIds(2, 5, 1, 0))
    assert (frames.length < frames.data.shape[1]).sum() >= 1  # the last span's shorter packet
    rx = Receiver(addr, 0)
    tx = Sender(addr, rx.port, dscp=10)
    calls = count_sendmmsg(monkeypatch)
    tx.send_frames(frames)
    got = []
    deadline = time.monotonic() + 30
    while len(got) < len(frames) and time.monotonic() < deadline:
        got += rx.recv_batch(timeout=0.5)
    assert [d.payload for d in got] == frames.payloads()
    assert tx.sent == len(frames) and tx.bytes == frames.nbytes
    runs = transport.gso_runs(frames.length)
    width = frames.data.shape[1]
    full, short = int(np.sum(frames.length == width)), int(np.sum(frames.length < width))
    assert runs["rows"].max() == 64 and len(runs) <= -(-full // 64) + -(-short // 64) + 1
    assert calls == [len(runs)]
    rx.close()
    tx.close()


def test_frames_sent_later_leave_in_order_from_the_senders_thread_and_errors_come_back():
    """Three buckets handed to `send_frames_later` arrive in order, every datagram; after
    `wait_sent` the counters hold them all. A send that fails raises in `wait_sent`."""
    buckets = [wire.packetize_frames(torch.randn(20_000, generator=torch.Generator().manual_seed(k)),
                                     get_codec("embedded"), coords=352, ids=wire.PacketIds(2, k, 1, 0))
               for k in range(3)]
    rx = Receiver("127.0.0.1", 0)
    tx = Sender("127.0.0.1", rx.port, dscp=10)
    for f in buckets:
        tx.send_frames_later(f)
    tx.wait_sent()
    want = [p for f in buckets for p in f.payloads()]
    assert tx.sent == len(want) and tx.bytes == sum(f.nbytes for f in buckets)
    got = []
    deadline = time.monotonic() + 30
    while len(got) < len(want) and time.monotonic() < deadline:
        got += rx.recv_batch(timeout=0.5)
    assert [d.payload for d in got] == want
    tx.sock.close()  # the thread's next sendmmsg fails (EBADF)
    tx.send_frames_later(buckets[0])
    with pytest.raises(OSError):
        tx.wait_sent()
    tx.wait_sent()  # raised once; the thread goes on
    tx.close()
    assert tx._later is None
    rx.close()


def test_a_node_logs_each_batch_from_a_copy_not_from_the_receive_buffer():
    """Two batches of one datagram each through a Node on loopback: the first one's logged
    header fields survive the second recvmmsg into the same buffer row."""
    from trimlab.agents.node import Node
    from trimlab.config import AgentConfig, CodecConfig, HostConfig, TransportConfig, WorkloadConfig

    codec = get_codec("embedded")
    for _ in range(20):  # the node binds port and port + 1: find a free pair
        probe = Receiver("127.0.0.1", 0)
        port = probe.port
        probe.close()
        cfg = AgentConfig(name="t", job=5, seed=1, steps=1, mtu=1500, topology="ps", workload=WorkloadConfig(),
                          codec=CodecConfig(name="embedded", span=1024, coords=256),
                          transport=TransportConfig(dscp=10, control_dscp=46, deadline_ms=10, port=port),
                          ps=HostConfig(name="ps1", addr="127.0.0.1"), workers=[HostConfig(name="w1", addr="127.0.0.1")])
        try:
            node = Node(cfg, "127.0.0.1", {"127.0.0.1": "w1"}, receive_gradients=True)
            break
        except OSError:
            continue
    try:
        payloads = wire.packetize(torch.randn(2048), codec, 1500, 256, 1024, wire.PacketIds(5, 0, 0, 0), 1)
        coll = node.expect(0, 0, {0: "127.0.0.1"}, 2048, 10.0)
        tx = Sender("127.0.0.1", port, 10)
        for p in payloads[:2]:
            tx.send(p)
            before = int(coll.received.sum())
            deadline = time.monotonic() + 60
            while int(coll.received.sum()) == before:  # this datagram is in (a batch of its own)
                assert time.monotonic() < deadline, "a datagram on loopback did not arrive in 60 s"
                node.pump(1.0)
        tx.close()
        rows = coll.rows
        assert rows["packet"].tolist() == [wire.parse_header(p).packet for p in payloads[:2]] == [0, 1]
        assert rows["status"].tolist() == ["accepted", "accepted"]
    finally:
        node.data.close()
        node.ctrl.close()


def test_hold_heap_is_accepted_by_glibc():
    """The agents' allocator setting: glibc takes both values (mallopt returns 0 for one
    out of its range); in a child, as it is process-wide."""
    out = subprocess.run([sys.executable, "-c", "from trimlab.agents.transport import hold_heap; print(hold_heap())"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
