"""The vectorized reader agrees with scapy's dissection field by field, on pcap and pcapng,
IPv4 and IPv6, VLAN-tagged and untagged, trimmed, truncated-snaplen and foreign packets."""

import struct

import numpy as np
import pytest
import torch
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Dot1Q, Ether
from scapy.packet import Raw
from scapy.utils import PcapNgWriter, PcapWriter

from trimlab import wire
from trimlab.analysis import pcap
from trimlab.codec import get_codec
from trimlab.scapy_layer import TrimGrad


def MAC():
    return Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")


def packets():
    codec = get_codec("embedded", planes=8)
    payloads = wire.packetize(torch.randn(3000), codec, coords=480, ids=wire.PacketIds(3, 9, 2, 1))
    out = []
    for i, p in enumerate(payloads):
        if i % 2:
            l3 = IP(src="198.19.0.10", dst="198.19.0.14", tos=(10 << 2) | 1)
        else:
            l3 = IPv6(src="fd00:7472::a", dst="fd00:7472::e", tc=48 << 2)
        if i == 3:
            p = p[:62]  # trimmed: header plus 38 body bytes
        pkt = MAC() / l3 / UDP(sport=40000 + i, dport=47000) / Raw(p)
        if i == 4:
            pkt = MAC() / Dot1Q(vlan=5) / pkt.payload
        pkt.time = 1_700_000_000 + i * 0.001 + 0.000123
        out.append(pkt)
    for i, extra in enumerate([IP(src="198.19.0.1", dst="198.19.0.2", tos=4) / TCP(sport=1, dport=2),
                               IP(src="198.19.0.1", dst="198.19.0.2") / UDP(sport=5, dport=6) / Raw(b"x" * 40)]):
        pkt = MAC() / extra
        pkt.time = 1_700_000_001 + i
        out.append(pkt)
    return out


def write(path, pkts, fmt):
    w = PcapNgWriter(str(path)) if fmt == "pcapng" else PcapWriter(str(path), linktype=1)
    for p in pkts:
        w.write(p)
    w.close()


def write_truncated(path, pkts, snaplen):
    """A pcap as tcpdump -s SNAPLEN writes it: records cut, original lengths kept."""
    out = [struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, snaplen, 1)]
    for p in pkts:
        raw = bytes(p)
        t = float(p.time)
        out.append(struct.pack("<IIII", int(t), int(round((t % 1) * 1e6)), min(len(raw), snaplen), len(raw)))
        out.append(raw[:snaplen])
    path.write_bytes(b"".join(out))


def scapy_row(p):
    p = Ether(bytes(p))  # dissect the bytes, as a capture would be
    ip = p.getlayer(IP) or p.getlayer(IPv6)
    tos = ip.tos if ip.version == 4 else ip.tc
    udp = p.getlayer(UDP)
    row = {"ip": ip.version, "dscp": tos >> 2, "ecn": tos & 3, "src": ip.src, "dst": ip.dst,
           "proto": ip.proto if ip.version == 4 else ip.nh,
           "ip_len": ip.len if ip.version == 4 else ip.plen}
    if udp is not None:
        row |= {"sport": udp.sport, "dport": udp.dport, "udp_len": udp.len}
        if udp.dport == 47000:
            t = TrimGrad(bytes(udp.payload))
            row |= {f: getattr(t, f) for f, _ in wire.HEADER_FIELDS}
    return row


@pytest.mark.parametrize("fmt", ["pcap", "pcapng"])
def test_fields_agree_with_scapy(tmp_path, fmt):
    pkts = packets()
    path = tmp_path / f"c.{fmt}"
    write(path, pkts, fmt)
    df = pcap.read(path)
    assert len(df) == len(pkts)
    for i, p in enumerate(pkts):
        got = df.iloc[i]
        assert got["caplen"] == got["wirelen"] == len(bytes(p))
        assert got["ts_ns"] // 1000 == int(round(float(p.time) * 1e6))
        for k, v in scapy_row(p).items():
            if k == "scale":
                assert np.isclose(got[k], v), (i, k)
            else:
                assert got[k] == v, (i, k, got[k], v)
    assert df["trimlab"].sum() == len(pkts) - 2
    trimmed = df[df["trimlab"] & (df["udp_len"] - 8 < df["length"])]
    assert list(trimmed.index) == [3]
    assert (df.loc[4, "ethertype"], df.loc[4, "ip"]) == (0x86DD, 6)  # through the VLAN tag


def test_truncated_snaplen_keeps_what_was_captured(tmp_path):
    pkts = packets()
    path = tmp_path / "c.pcap"
    write_truncated(path, pkts, 60)  # IPv4 header + UDP + 18 bytes: no whole trimlab header
    df = pcap.read(path)
    v4 = df[(df["ip"] == 4) & (df["dport"] == 47000)]
    assert (v4["caplen"] == 60).all() and (v4["wirelen"] > 60).all()
    assert not v4["trimlab"].any() and (v4["dport"] >= 0).all()
    v6 = df[df["ethertype"] == 0x86DD]
    assert (v6["ip"] == 6).all() and (v6["sport"] == -1).all()  # 60 bytes end inside UDP
    assert (df["ts_ns"] > 0).all()


def test_cut_file_and_bad_files(tmp_path):
    pkts = packets()
    path = tmp_path / "c.pcap"
    write(path, pkts, "pcap")
    raw = path.read_bytes()
    (tmp_path / "cut.pcap").write_bytes(raw[:-10])  # tcpdump killed mid-record
    assert len(pcap.read(tmp_path / "cut.pcap")) == len(pkts) - 1
    (tmp_path / "x.pcap").write_bytes(b"not a capture file at all.")
    with pytest.raises(pcap.PcapError, match="not a pcap or pcapng file"):
        pcap.read(tmp_path / "x.pcap")


@pytest.mark.parametrize("fmt", ["pcap", "pcapng"])
def test_compiled_and_python_walks_agree(tmp_path, fmt):
    path = tmp_path / f"c.{fmt}"
    write(path, packets(), fmt)
    buf = np.fromfile(path, dtype=np.uint8)
    assert pcap._walker() is not None  # make setup installs gcc; the fallback is for other hosts
    compiled = pcap._walk(buf, len(buf), fmt)
    assert len(compiled) > 0 and np.array_equal(compiled, pcap._walk(buf, len(buf), fmt, python=True))
    cut = buf[:-7]
    assert np.array_equal(pcap._walk(cut, len(cut), fmt), pcap._walk(cut, len(cut), fmt, python=True))


def test_big_endian_pcap(tmp_path):
    pkts = packets()
    out = [struct.pack(">IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1)]
    for p in pkts:
        raw = bytes(p)
        t = float(p.time)
        out.append(struct.pack(">IIII", int(t), int(round((t % 1) * 1e6)), len(raw), len(raw)) + raw)
    (tmp_path / "be.pcap").write_bytes(b"".join(out))
    write(tmp_path / "le.pcap", pkts, "pcap")
    be, le = pcap.read(tmp_path / "be.pcap"), pcap.read(tmp_path / "le.pcap")
    assert be.drop(columns=["ts_ns"]).equals(le.drop(columns=["ts_ns"]))
    assert (abs(be["ts_ns"] - le["ts_ns"]) < 1000).all()


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_a_trimmed_packet_with_stale_lengths_is_measured_by_its_frame(tmp_path, v6):
    """Real switches cut the frame and leave the IP and UDP lengths as sent: the reader's
    udp_payload is the frame's, udp_len and ip_len stay what the headers say; a short
    frame padded on the wire is measured by its UDP length."""
    codec = get_codec("embedded", planes=8)
    payload = wire.packetize(torch.randn(480), codec, coords=480, ids=wire.PacketIds(3, 9, 2, 1))[0]
    l3 = IPv6(src="fd00:7472::a", dst="fd00:7472::e") if v6 else IP(src="198.19.0.10", dst="198.19.0.14")
    whole = bytes(MAC() / l3 / UDP(sport=40000, dport=47000) / Raw(payload))
    cut = Ether(whole[:128])  # stale: its headers still say len(whole)
    padded = Ether(bytes(MAC() / IP(src="198.19.0.1", dst="198.19.0.2") / UDP(sport=5, dport=6) / Raw(b"x" * 4))
                   + bytes(10))
    write(tmp_path / "c.pcap", [cut, padded], "pcap")
    df = pcap.read(tmp_path / "c.pcap")
    l4 = 14 + (40 if v6 else 20)
    assert df.loc[0, "udp_payload"] == 128 - l4 - 8
    assert df.loc[0, "udp_len"] == len(whole) - l4 and df.loc[0, "length"] == len(payload)
    assert df.loc[0, "ip_len"] == len(whole) - 14 - (40 if v6 else 0)
    assert df.loc[1, "udp_payload"] == 4
