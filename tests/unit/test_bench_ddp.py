"""`trimlab bench ddp`'s wire-time bounds: the frame bytes one rank sends in a step, per
contender, from the codec's own packet sizes (the hook) and a ring all-reduce's share in
TCP segments (gloo); jumbo frames carry the same values in fewer, larger frames."""

import pytest

from trimlab import wire
from trimlab.agents.reliable import CTRL
from trimlab.bench.ddp import TCP_IP_LEN, wire_bytes
from trimlab.codec import get_codec


@pytest.mark.unit
def test_gloo_sends_its_ring_share_in_tcp_segments():
    params, mtu = 4 * 100_000, 1500
    ring = 2 * 3 * 100_000 * 4  # 2(N − 1)/N of the float32 values, N = 4
    segments = -(-ring // (mtu - TCP_IP_LEN))
    assert wire_bytes(params, mtu)["allreduce"] == ring + segments * (TCP_IP_LEN + wire.ETH_LEN)


@pytest.mark.unit
def test_the_hook_sends_three_shards_twice_each_in_about_two_bytes_a_value():
    params = 4 * 131_072
    hook = wire_bytes(params, 1500)["hook"]
    codec = get_codec("embedded", planes=16)
    body = 3 * 2 * 131_072 * codec.body_bytes(32) // 32  # scatter + gather, 16 planes: 2 bytes a value
    assert body < hook < 1.1 * body  # + headers: trimlab's, UDP/IP, Ethernet, the chunks' CTRL
    assert CTRL.size < wire.HEADER_LEN


@pytest.mark.unit
def test_jumbo_frames_send_fewer_header_bytes():
    for params in (4810, 1_076_010):
        small, jumbo = wire_bytes(params, 1500), wire_bytes(params, 9000)
        assert jumbo["hook"] < small["hook"] and jumbo["allreduce"] < small["allreduce"]
