import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scapy.layers.inet import IP, UDP
from scapy.layers.inet6 import IPv6
from scapy.packet import Raw

from trimlab import wire
from trimlab.codec import CODECS, get_codec
from trimlab.config import GRADIENT_PORT
from trimlab.errors import WireError
from trimlab.scapy_layer import TrimGrad

IDS = wire.PacketIds(job=77, step=123456, rank=3, bucket=9)


def test_header_is_24_bytes_and_declared_once():
    assert wire.HEADER_LEN == 24
    assert sum(8 * 4 if w == "f32" else w for _, w in wire.HEADER_FIELDS) == 24 * 8
    assert [f.name for f in TrimGrad.fields_desc] == [n for n, _ in wire.HEADER_FIELDS]


@pytest.mark.parametrize("ipv6", [False, True])
@pytest.mark.parametrize("mtu", [1280, 1500, 9000])
@pytest.mark.parametrize("name", list(CODECS))
def test_packets_fill_but_never_exceed_the_mtu(name, mtu, ipv6):
    codec = get_codec(name)
    x = torch.randn(50000)
    pays = wire.packetize(x, codec, mtu=mtu, ipv6=ipv6, ids=IDS)
    biggest = max(len(p) for p in pays) + wire.ip_udp_overhead(ipv6)
    assert biggest <= mtu
    assert biggest > mtu - codec.body_bytes(32) or wire.max_coords(codec, mtu, ipv6) >= 4096


def test_packetize_refuses_coords_over_the_mtu():
    with pytest.raises(WireError, match="coords=1024 does not fit mtu=1500"):
        wire.packetize(torch.randn(10), get_codec("fp32"), mtu=1500, coords=1024)


@pytest.mark.parametrize("name", list(CODECS))
def test_packetize_depacketize_roundtrip_with_trims_losses_and_junk(name):
    codec = get_codec(name)
    x = torch.randn(20000, generator=torch.Generator().manual_seed(1))
    b = wire.max_coords(codec, 1500)
    pays = wire.packetize(x, codec, ids=IDS, seed=4)
    full = wire.depacketize(pays, codec, x.numel(), IDS, coords=b, seed=4)
    assert not full.decoded.missing.any() and not full.trimmed.any() and not full.discarded
    assert float(((full.decoded.tensor - x) ** 2).sum() / (x ** 2).sum()) < 1e-5
    other = wire.packetize(x, codec, ids=wire.PacketIds(job=5), seed=4)[:3]
    got = [p[:128 - 42] for p in pays[::2]] + pays[3::2][1:] + other + [b"\x00" * 10, pays[1]]
    d = wire.depacketize(got[::-1], codec, x.numel(), IDS, coords=b, seed=4)
    assert d.discarded == {"other_job": 3, "short": 1}
    assert d.trimmed.sum() == len(pays[::2]) and d.decoded.missing.any()
    sent = {(h.span, h.packet): len(p) for p in pays for h in [wire.parse_header(p)]}
    heads = [(wire.parse_header(p), len(p)) for p in got[::-1] if len(p) >= wire.HEADER_LEN]
    got_len = {(h.span, h.packet): n for h, n in heads if h.job == IDS.job}
    keys = list(zip(d.packets.span.tolist(), d.packets.index.tolist()))
    assert d.sent_length.tolist() == [sent[k] for k in keys]
    assert (d.packets.length + wire.HEADER_LEN).tolist() == [got_len[k] for k in keys]


def test_parse_header_errors_are_clear():
    with pytest.raises(WireError, match="shorter than the 24-byte trimlab header"):
        wire.parse_header(b"\xa1" * 23)
    with pytest.raises(WireError, match="not a trimlab v1 packet"):
        wire.parse_header(b"\x00" * 24)


def test_packet_ids_must_fit_their_fields():
    with pytest.raises(WireError, match="rank=70000"):
        wire.PacketIds(rank=70000)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.binary(min_size=0, max_size=200), max_size=20), st.sampled_from(list(CODECS)))
def test_random_bytes_never_crash_depacketize(payloads, name):
    codec = get_codec(name)
    d = wire.depacketize(payloads, codec, 3000, IDS, coords=352)
    assert sum(d.discarded.values()) + len(d.packets) == len(payloads)


@settings(max_examples=100, deadline=None)
@given(st.binary(min_size=0, max_size=64))
def test_random_bytes_parse_or_raise_wire_error(payload):
    try:
        wire.parse_header(payload)
    except WireError:
        pass


def _header_dict(h: wire.Header) -> dict:
    return {k: v for k, v in h.__dict__.items()}


@pytest.mark.parametrize("ipv6", [False, True])
def test_scapy_dissects_what_wire_builds(ipv6):
    codec = get_codec("embedded")
    pays = wire.packetize(torch.randn(9000), codec, ids=IDS, ipv6=ipv6, seed=2)
    for pay in pays[:3] + pays[-1:]:
        l3 = IPv6(dst="fd00:7472::2") if ipv6 else IP(dst="198.19.0.2")
        frame = (IPv6 if ipv6 else IP)(bytes(l3 / UDP(sport=40000, dport=GRADIENT_PORT) / Raw(pay)))
        tg = frame[TrimGrad]
        head = wire.parse_header(pay)
        for name, _ in wire.HEADER_FIELDS:
            want = getattr(head, name)
            assert getattr(tg, name) == pytest.approx(want, rel=1e-7), name
        assert bytes(tg.payload) == pay[wire.HEADER_LEN:]
        assert frame[UDP].len == len(pay) + 8


@pytest.mark.parametrize("ipv6", [False, True])
def test_wire_parses_and_decodes_what_scapy_builds(ipv6):
    codec = get_codec("fp32")
    values = np.arange(64, dtype="<f4")
    l3 = IPv6(src="fd00:7472::1", dst="fd00:7472::2") if ipv6 else IP(src="198.19.0.1", dst="198.19.0.2")
    pkt = l3 / UDP(dport=GRADIENT_PORT) / TrimGrad(
        codec=codec.codec_id, flags=codec.flags, planes=codec.planes, job=IDS.job, step=IDS.step,
        rank=IDS.rank, bucket=IDS.bucket, span=0, packet=0, coords=64) / Raw(values.tobytes())
    raw = bytes(pkt)
    payload = bytes((IPv6 if ipv6 else IP)(raw)[UDP].payload)
    head = wire.parse_header(payload)
    assert (head.job, head.step, head.rank, head.bucket, head.coords) == (77, 123456, 3, 9, 64)
    assert head.length == wire.HEADER_LEN + 256  # filled in by the layer as built
    trimmed = payload[:wire.HEADER_LEN + 40]
    d = wire.depacketize([trimmed], codec, 64, IDS, coords=64)
    assert d.trimmed.tolist() == [True]
    assert d.decoded.tensor[:10].tolist() == values[:10].tolist()
    assert d.decoded.missing.tolist() == [False] * 10 + [True] * 54
