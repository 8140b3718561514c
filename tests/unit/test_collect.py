"""agents.collect.Collector on batches of arrays (no sockets): every body lands in its
slot, duplicates and foreign packets are logged and counted, and the reduction equals
decoding the same payloads with wire.depacketize."""

import collections

import numpy as np
import pytest
import torch

from trimlab import wire
from trimlab.agents.collect import Collector
from trimlab.agents.context import NodeContext
from trimlab.agents.rx import Arrived
from trimlab.codec import get_codec
from trimlab.config import PACKET_LOG_FIELDS

JOB, SEED, SPAN, NUMEL = 3, 9, 1024, 5000
ADDRS = ["198.19.0.11", "198.19.0.12", "198.19.0.99"]


@pytest.fixture(autouse=True, params=["native", "numpy"])
def rx_impl(request, monkeypatch):
    """Every test with both receive paths (agents.rx)."""
    monkeypatch.setenv("TRIMLAB_RX_IMPL", request.param)
    return request.param


def node(codec) -> NodeContext:
    """What a collector gets of its node (no sockets: it never sends)."""
    return NodeContext(codec, JOB, SEED, SPAN, 256, 1500, False, list(ADDRS), ADDRS.index, str, {},
                       collections.Counter(), send_control=lambda data, dest: True, unsent_control=lambda: 0,
                       state=lambda: "")


def arrived(payloads: list[bytes], peer: list[int], slot: int = 2048) -> Arrived:
    """Payloads as a receive batch lays them out: rows of a reused buffer whose bytes past
    each datagram are left over from before (here: 0xEE)."""
    data = np.full((len(payloads), slot), 0xEE, dtype=np.uint8)
    for i, p in enumerate(payloads):
        data[i, :len(p)] = np.frombuffer(p, dtype=np.uint8)
    head = wire.split_fields(np.ascontiguousarray(data[:, :wire.HEADER_LEN]).view(wire.HEADER_DTYPE)[:, 0])
    return Arrived(data, np.array([len(p) for p in payloads]), np.full(len(payloads), 10), np.array(peer), head,
                   123)


@pytest.mark.parametrize("impl", ["native", "torch"])
@pytest.mark.parametrize("name", ["embedded", "sign_tail", "fp32"])
def test_batches_reduce_like_depacketize(name, impl, monkeypatch):
    """Also: the bytes a trimmed body's row keeps past its length (0xEE here) reach the
    decoder, which reads a body only up to its length, in either implementation."""
    monkeypatch.setenv("TRIMLAB_CODEC_IMPL", impl)
    codec = get_codec(name)
    grads = [torch.randn(NUMEL, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    pk = [wire.packetize(g, codec, coords=256, span=SPAN, ids=wire.PacketIds(JOB, 4, r, 1), seed=SEED)
          for r, g in enumerate(grads)]
    rng = np.random.default_rng(0)
    # rank 0: every packet, some trimmed; rank 1: some lost; both shuffled over three batches
    sent0 = [p[:wire.HEADER_LEN + int(rng.integers(0, len(p) - wire.HEADER_LEN) // 4 * 4)] if i % 3 == 0 else p
             for i, p in enumerate(pk[0])]
    sent1 = [p for i, p in enumerate(pk[1]) if i not in (1, len(pk[1]) - 1)]  # the first and last span
    stream = [(p, 0) for p in sent0] + [(p, 1) for p in sent1]
    order = rng.permutation(len(stream))
    stream = [stream[i] for i in order]
    stream += [stream[0], stream[5]]  # duplicates, in a later batch
    stream.insert(3, (pk[1][0], 2))  # rank 1's packet from another host
    coll = Collector(node(codec), 4, 1, {0: ADDRS[0], 1: ADDRS[1]}, NUMEL, deadline_s=1.0)
    for part in np.array_split(np.arange(len(stream)), 3):
        coll.add(arrived([stream[i][0] for i in part], [stream[i][1] for i in part]))
    assert coll.received.tolist() == [len(sent0), len(sent1)] and not coll.complete
    local = torch.randn(NUMEL, generator=torch.Generator().manual_seed(9))
    red = coll.reduce(local=local)
    ctx = dict(span=SPAN, coords=256, seed=SEED)
    dps = [wire.depacketize(s, codec, NUMEL, wire.PacketIds(JOB, 4, r, 1), **ctx) for r, s in enumerate((sent0, sent1))]
    total, count = local.clone(), torch.ones(NUMEL)
    for dp in dps:
        total += dp.decoded.tensor.masked_fill(dp.decoded.missing, 0)
        count += ~dp.decoded.missing
    assert torch.equal(red.mean, total / count.clamp(min=1))
    assert red.min_contributors == int(count.min())
    assert red.trimmed == sum(int(dp.trimmed.sum()) for dp in dps)
    assert red.missing == red.expected - len(sent0) - len(sent1)
    rows = coll.rows
    assert list(rows) == list(PACKET_LOG_FIELDS) and len(rows["step"]) == len(stream) - 1  # not the foreign one
    assert collections.Counter(rows["status"].tolist()) == {"accepted": len(sent0) + len(sent1), "duplicate": 2}
    assert set(rows["src"].tolist()) == set(ADDRS[:2])
    assert coll.node_ctx.discarded == {"duplicate": 2, "rank_mismatch": 1}
    accepted = rows["status"] == "accepted"
    assert (rows["planes"][accepted] >= 0).all() and (rows["planes"][~accepted] == -1).all()
    assert rows["trimmed"][accepted].sum() == red.trimmed


def test_each_body_lands_in_its_ranks_slot_in_runs_and_out_of_them():
    """Batches whose slots run on while the rank changes (rank 0 slot 0, rank 1 slot 1, rank
    0 slot 2), in order across one rank, and reversed: every body lands in its own row."""
    codec = get_codec("fp32")
    pk = [wire.packetize(torch.randn(NUMEL, generator=torch.Generator().manual_seed(r)), codec, coords=256, span=SPAN,
                         ids=wire.PacketIds(JOB, 4, r, 1), seed=SEED) for r in range(2)]
    coll = Collector(node(codec), 4, 1, {0: ADDRS[0], 1: ADDRS[1]}, NUMEL, deadline_s=1.0)
    batches = [[(0, 0), (1, 1), (0, 2)], [(0, 3), (0, 4), (0, 5)], [(1, 5), (1, 4), (1, 3)]]
    for batch in batches:
        coll.add(arrived([pk[r][i] for r, i in batch], [r for r, _ in batch]))
    for r, i in (x for b in batches for x in b):
        body = np.frombuffer(pk[r][i][wire.HEADER_LEN:], dtype=np.uint8)
        assert (coll.body[r, i, :len(body)] == body).all() and coll.got[r, i] == len(body)
    assert coll.received.tolist() == [5, 4]


def test_malformed_packets_are_logged_with_their_reason():
    codec = get_codec("embedded")
    good = wire.packetize(torch.ones(NUMEL), codec, coords=256, span=SPAN, ids=wire.PacketIds(JOB, 4, 0, 1), seed=SEED)
    other = wire.packetize(torch.ones(NUMEL), get_codec("fp32"), coords=256, span=SPAN,
                           ids=wire.PacketIds(JOB, 4, 0, 1), seed=SEED)
    coll = Collector(node(codec), 4, 1, {0: ADDRS[0]}, NUMEL, deadline_s=1.0)
    coll.add(arrived([good[0], other[0], good[1] + b"xx"], [0, 0, 0]))
    assert coll.rows["status"].tolist() == ["accepted", "other_codec", "bad_length"]
    assert coll.received.tolist() == [1]


def test_a_bucket_lost_whole_ends_at_the_deadline_once_peers_said_they_sent_it():
    """No packet of a bucket arrives (every one dropped): once the peer said it sent them
    (its stream's SENT mark, here (3, 1) or any later bucket), collection ends after the
    deadline with everything missing; without that it waits for the step timeout and says so."""
    from trimlab.agents.failure import ProtocolError
    from trimlab.agents.node import Node
    from trimlab.config import AgentConfig
    cfg = AgentConfig.model_validate({
        "name": "t", "job": JOB, "seed": SEED, "steps": 1, "mtu": 1500, "topology": "sharded",
        "workload": {"kind": "ddp"}, "codec": {"name": "embedded", "span": SPAN, "coords": 256},
        "transport": {"dscp": 10, "control_dscp": 46, "deadline_ms": 50, "port": 47440},
        "workers": [{"name": "w1", "addr": "127.0.44.1"}, {"name": "w2", "addr": "127.0.44.2"}]})
    node = Node(cfg, "127.0.44.1", {"127.0.44.2": "w2"}, receive_gradients=True)
    try:
        coll = node.expect(3, 1, {1: "127.0.44.2"}, NUMEL, 0.05)
        node.sent_to_us["127.0.44.2"] = (3, 3)
        node.collect(coll, step_timeout_s=60)
        red = coll.reduce(local=torch.ones(NUMEL))
        assert red.packets == 0 and red.missing == red.expected and torch.equal(red.mean, torch.ones(NUMEL))
        coll = node.expect(4, 1, {1: "127.0.44.2"}, NUMEL, 0.05)
        with pytest.raises(ProtocolError, match="no gradient packets of step 4 from w2"):
            node.collect(coll, step_timeout_s=0.3)
    finally:
        node.data.close()
        node.ctrl.close()


def test_a_batch_ends_where_the_open_collectors_are_complete():
    """Two steps' packets queued at once: the node reads no further than the open
    collector misses, so the next step's packets wait in the socket for their own collector
    instead of being copied aside as early ones; both steps arrive whole."""
    from trimlab.agents.node import Node
    from trimlab.agents.transport import Sender
    from trimlab.config import AgentConfig
    cfg = AgentConfig.model_validate({
        "name": "t", "job": JOB, "seed": SEED, "steps": 2, "mtu": 1500, "topology": "ps", "workload": {},
        "codec": {"name": "embedded", "span": SPAN, "coords": 256},
        "transport": {"dscp": 10, "control_dscp": 46, "deadline_ms": 5000, "port": 47450},
        "ps": {"name": "ps1", "addr": "127.0.45.1"}, "workers": [{"name": "w1", "addr": "127.0.45.2"}]})
    node = Node(cfg, "127.0.45.1", {"127.0.45.2": "w1"}, receive_gradients=True)
    tx = Sender("127.0.45.1", 47450, 10, bind="127.0.45.2")
    codec, numel = get_codec("embedded"), 100_000  # 391 packets a step: two steps fit one batch
    try:
        grads = [torch.randn(numel, generator=torch.Generator().manual_seed(s)) for s in (3, 4)]
        for step, g in zip((3, 4), grads):
            tx.send_frames(wire.packetize_frames(g, codec, 1500, 256, SPAN, wire.PacketIds(JOB, step, 0, 0), SEED))
        for step, g in zip((3, 4), grads):
            coll = node.collect(node.expect(step, 0, {0: "127.0.45.2"}, numel, 5.0), step_timeout_s=60)
            assert not node.early and node.discarded.total() == 0
            red = coll.reduce()
            assert red.missing == 0 and red.packets == coll.expected
            assert torch.equal(red.mean, codec.decode(codec.encode(g, coll.ctx), coll.ctx, numel).tensor)
    finally:
        tx.close()
        node.close()
