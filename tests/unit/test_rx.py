"""agents.rx: the native receive path (rx.c) and its numpy reference leave the same
collectors, packet logs, early packets and discard counters, batch after batch, on a
stream with every kind of bad datagram in it."""

import collections
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from trimlab import wire
from trimlab.agents import rx
from trimlab.agents.collect import Collector
from trimlab.agents.context import NodeContext
from trimlab.agents.node import Node
from trimlab.agents.transport import Batch, packed_addr
from trimlab.codec import get_codec

JOB, SEED, SPAN, COORDS, NUMEL = 3, 9, 1024, 256, 5000
ADDRS = ["198.19.0.11", "198.19.0.12"]
STRANGER = "198.19.0.99"
RANKS = {0: ADDRS[0], 1: ADDRS[1]}


def edit(payload: bytes, **fields) -> bytes:
    """The payload with some header fields changed."""
    h = np.frombuffer(payload[:wire.HEADER_LEN], dtype=wire.HEADER_DTYPE).copy()
    for k, v in fields.items():
        h[k] = v
    return h.tobytes() + payload[wire.HEADER_LEN:]


def stream(codec, seed: int) -> list[tuple[bytes, str, bool]]:
    """(payload, source, truncated by the receiver) in arrival order."""
    rng = np.random.default_rng(seed)
    out = []
    for step, bucket in ((4, 1), (4, 2), (5, 1), (3, 1)):  # (3, 1) is over; (5, 1) not open yet
        for r in (0, 1):
            g = torch.randn(NUMEL, generator=torch.Generator().manual_seed(100 * step + 10 * bucket + r))
            for p in wire.packetize(g, codec, coords=COORDS, span=SPAN, ids=wire.PacketIds(JOB, step, r, bucket),
                                    seed=SEED):
                if rng.random() < 0.3:  # trimmed on the way
                    p = p[:wire.HEADER_LEN + int(rng.integers(0, len(p) - wire.HEADER_LEN))]
                out.append((p, ADDRS[r], False))
    # the bad ones are rank 0's packets of an open collector, from rank 0's address
    good = [p for p, a, _ in out if a == ADDRS[0] and wire.parse_header(p).step == 4]
    pick = lambda: good[int(rng.integers(len(good)))]  # noqa: E731
    a0 = ADDRS[0]
    bad = [
        (pick(), STRANGER, False),  # unknown source
        (pick()[:20], a0, False),  # shorter than a header
        (pick(), a0, True),  # cut by the receiver
        (edit(pick(), magic_version=0x51), a0, False),
        (edit(pick(), job=JOB + 1), a0, False),
        (pick(), ADDRS[1], False),  # rank 0's packet from rank 1's address
        (edit(pick(), rank=7), a0, False),  # a rank nobody expects
        (edit(pick(), codec_flags=0x00), a0, False),
        (edit(pick(), planes=3), a0, False),
        (edit(pick(), coords=COORDS - 32), a0, False),  # not the layout's
        (edit(pick(), length=1400), a0, False),
        # a packet the layout has no slot for, claiming no coordinates: must not land anywhere
        (edit(pick()[:wire.HEADER_LEN], span=900, packet=0, coords=0, length=wire.HEADER_LEN), a0, False),
    ]
    out += bad + [out[i] for i in rng.integers(0, len(out), 25)]  # and duplicates
    return [out[i] for i in rng.permutation(len(out))]


def batches(items, sizes) -> list[Batch]:
    """Receive batches as recvmmsg leaves them: rows of one reused buffer (bytes past each
    datagram left over from before: 0xEE first, then earlier datagrams)."""
    buf = np.full((max(sizes), 1536), 0xEE, dtype=np.uint8)
    out, at = [], 0
    for n in sizes:
        part = items[at:at + n]
        at += n
        for i, (p, _, _) in enumerate(part):
            buf[i, :len(p)] = np.frombuffer(p, dtype=np.uint8)
        addr = np.stack([packed_addr(a) for _, a, _ in part])
        out.append(Batch(buf[:len(part)].copy(), np.array([len(p) for p, _, _ in part], dtype=np.int64),
                         np.array([t for _, _, t in part]), np.full(len(part), 40, dtype=np.int64), addr,
                         np.full(len(part), 5000, dtype=np.int64), 1000 + at, False))
    return out


def fake_node(codec):
    """What Node's receiving methods use of a node, without its sockets."""
    n = SimpleNamespace(codec=codec, span=SPAN, coords=COORDS, seed=SEED, job=JOB, peers=dict.fromkeys(ADDRS, "w"),
                        peer_addrs=list(ADDRS), _peer_table=np.stack([packed_addr(a) for a in ADDRS]),
                        collectors={}, done_steps={(3, 1)}, early={}, early_bytes=0, early_max_bytes=8 << 20,
                        discarded=collections.Counter(), last_heard={})
    n.peer_index = ADDRS.index
    n.ctx = NodeContext(codec, JOB, SEED, SPAN, COORDS, 1500, False, n.peer_addrs, n.peer_index, str, n.last_heard,
                        n.discarded, send_control=lambda data, dest: True, unsent_control=lambda: 0, state=lambda: "")
    return n


def run(codec, impl: str, monkeypatch, items, sizes):
    monkeypatch.setenv("TRIMLAB_RX_IMPL", impl)
    assert rx.implementation() == impl
    node = fake_node(codec)
    for key in ((4, 1), (4, 2)):
        node.collectors[key] = Collector(node.ctx, *key, RANKS, NUMEL, deadline_s=1.0)
    for b in batches(items, sizes):
        Node._on_gradients(node, b, 7.0)
    late = Node.expect(node, 5, 1, RANKS, NUMEL, 1.0)  # takes the packets kept for it
    return node, [node.collectors[(4, 1)], node.collectors[(4, 2)], late]


@pytest.mark.parametrize("name", ["embedded", "fp32"])
@pytest.mark.parametrize("sizes", [[1024], [1, 2, 300, 1024], [7] * 200])
def test_native_and_numpy_receive_alike(name, sizes, monkeypatch):
    codec = get_codec(name)
    items = stream(codec, seed=len(sizes))
    sizes = [min(s, len(items) - sum(sizes[:i])) for i, s in enumerate(sizes) if sum(sizes[:i]) < len(items)]
    if sum(sizes) < len(items):
        sizes.append(len(items) - sum(sizes))
    ref_node, ref = run(codec, "numpy", monkeypatch, items, sizes)
    nat_node, nat = run(codec, "native", monkeypatch, items, sizes)
    assert ref_node.discarded == nat_node.discarded
    for reason in ("unknown_source", "not_trimlab", "other_job", "rank_mismatch", "other_codec", "other_stream",
                   "bad_layout", "bad_length", "duplicate", "late"):
        assert ref_node.discarded[reason] > 0 or reason == "other_stream", reason
    assert ref_node.last_heard == nat_node.last_heard and set(ref_node.last_heard) == set(ADDRS)
    for a, b in zip(ref, nat):
        for field in ("got", "scale", "sent", "received"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert np.array_equal(a.body[a.got >= 0], b.body[b.got >= 0])  # (the rest is never read)
        ra, rb = a.rows, b.rows
        assert list(ra) == list(rb)
        for k in ra:
            assert ra[k].tolist() == rb[k].tolist(), k
        assert torch.equal(a.reduce().mean, b.reduce().mean)
    assert all(c.received.sum() > 0 for c in nat)


@pytest.mark.parametrize("impl", ["numpy", "native"])
def test_a_packet_without_a_slot_lands_nowhere(impl, monkeypatch):
    """A header naming a span the layout lacks, and claiming 0 coordinates and no body,
    passes every other check: it is a bad layout, not a write to some slot."""
    monkeypatch.setenv("TRIMLAB_RX_IMPL", impl)
    codec = get_codec("embedded")
    node = fake_node(codec)
    coll = node.collectors[(4, 1)] = Collector(node.ctx, 4, 1, RANKS, NUMEL, deadline_s=1.0)
    p = wire.packetize(torch.randn(NUMEL), codec, coords=COORDS, span=SPAN, ids=wire.PacketIds(JOB, 4, 0, 1),
                       seed=SEED)[-1]
    ghost = edit(p[:wire.HEADER_LEN], span=900, packet=0, coords=0, length=wire.HEADER_LEN)
    for b in batches([(p, ADDRS[0], False), (ghost, ADDRS[0], False)], [2]):
        Node._on_gradients(node, b, 0.0)
    assert node.discarded == {"bad_layout": 1} and coll.received.tolist() == [1, 0]
    assert coll.rows["status"].tolist() == ["accepted", "bad_layout"]


def test_rx_impl_is_checked(monkeypatch):
    monkeypatch.setenv("TRIMLAB_RX_IMPL", "fast")
    with pytest.raises(Exception, match="TRIMLAB_RX_IMPL='fast': choose auto, native or numpy"):
        rx.implementation()
