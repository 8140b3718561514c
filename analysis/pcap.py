"""A vectorized pcap / pcapng reader: the file is one numpy byte array; only the walk from
record to record is a loop (over integers: each record's offset depends on the previous
record's length), every field is then gathered for all packets at once.

    df = read("run/pcaps/w1.pcap")   # one row per packet

Columns: ts_ns, caplen, wirelen, ethertype, ip (4 | 6 | 0), dscp, ecn, ip_len (IPv4 total
length / IPv6 payload length), proto, src, dst, sport, dport, udp_len, and, for UDP
packets to or from `port` whose capture holds the whole trimlab header, the header's fields
(magic … scale, from testbed.wire.HEADER_FIELDS) plus `trimlab` (bool). Missing values
are -1 (or NaN for scale). scapy stays for declaring and dissecting the protocol.
"""

from __future__ import annotations

import ipaddress
import struct
from pathlib import Path

import numpy as np
import pandas as pd

from testbed import wire
from testbed.errors import TrimlabError

LINKTYPE_ETHERNET = 1
PCAP_MAGIC = {b"\xd4\xc3\xb2\xa1": ("<", 1_000), b"\xa1\xb2\xc3\xd4": (">", 1_000),
              b"\x4d\x3c\xb2\xa1": ("<", 1), b"\xa1\xb2\x3c\x4d": (">", 1)}
PCAPNG_SHB = 0x0A0D0D0A


class PcapError(TrimlabError):
    """A capture file that is not pcap/pcapng, or not Ethernet."""


def _records_pcap(buf: np.ndarray, raw: bytes):
    order, ns_per_frac = PCAP_MAGIC[raw[:4]]
    link = struct.unpack_from(order + "I", raw, 20)[0]
    if link != LINKTYPE_ETHERNET:
        raise PcapError(f"linktype {link}: only Ethernet (1) captures are read")
    rec = struct.Struct(order + "IIII")
    offs, n, end = [], 24, len(raw) - 16
    unpack = rec.unpack_from
    while n <= end:
        incl = unpack(raw, n)[2]
        if n + 16 + incl > len(raw):
            break  # a capture cut mid-record (tcpdump killed): keep what is whole
        offs.append(n)
        n += 16 + incl
    o = np.asarray(offs, dtype=np.int64)
    hdr = np.dtype([("sec", order + "u4"), ("frac", order + "u4"), ("incl", order + "u4"), ("orig", order + "u4")])
    idx = o[:, None] + np.arange(16)
    h = buf[idx].reshape(-1).view(hdr) if len(o) else np.zeros(0, dtype=hdr)
    ts = h["sec"].astype(np.int64) * 1_000_000_000 + h["frac"].astype(np.int64) * ns_per_frac
    return o + 16, h["incl"].astype(np.int64), h["orig"].astype(np.int64), ts


def _records_pcapng(raw: bytes):
    """Enhanced packet blocks of Ethernet interfaces; timestamps per interface resolution."""
    offs, caps, origs, ts = [], [], [], []
    ifaces: list[tuple[int, int]] = []  # (linktype, ns per tick)
    order = "<"
    n = 0
    while n + 12 <= len(raw):
        btype = struct.unpack_from(order + "I", raw, n)[0]
        if btype == PCAPNG_SHB:
            order = "<" if raw[n + 8:n + 12] == b"\x4d\x3c\x2b\x1a" else ">"
            ifaces = []
        blen = struct.unpack_from(order + "I", raw, n + 4)[0]
        if blen < 12 or n + blen > len(raw):
            break
        if btype == 1:  # interface description
            link = struct.unpack_from(order + "H", raw, n + 8)[0]
            ns = 1_000  # default resolution: microseconds
            p = n + 16
            while p + 4 <= n + blen - 4:
                code, length = struct.unpack_from(order + "HH", raw, p)
                if code == 0:
                    break
                if code == 9 and length >= 1:  # if_tsresol
                    r = raw[p + 4]
                    ns = (10 ** 9 // 10 ** r) if not r & 0x80 else max(1, int(1e9 / 2 ** (r & 0x7F)))
                p += 4 + (length + 3) // 4 * 4
            ifaces.append((link, ns))
        elif btype == 6:  # enhanced packet
            iface, hi, lo, cap, orig = struct.unpack_from(order + "IIIII", raw, n + 8)
            link, ns = ifaces[iface] if iface < len(ifaces) else (None, 1_000)
            if link != LINKTYPE_ETHERNET:
                raise PcapError(f"pcapng interface {iface}: linktype {link}; only Ethernet is read")
            offs.append(n + 28)
            caps.append(cap)
            origs.append(orig)
            ts.append(((hi << 32) | lo) * ns)
        n += blen
    a = lambda v: np.asarray(v, dtype=np.int64)  # noqa: E731
    return a(offs), a(caps), a(origs), a(ts)


def _gather(buf: np.ndarray, start: np.ndarray, limit: np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes buf[start : start + width] per packet, and whether they lie within `limit`."""
    ok = (start >= 0) & (start + width <= limit)
    idx = np.where(ok, start, 0)[:, None] + np.arange(width)
    return buf[np.minimum(idx, len(buf) - 1)], ok


def _be(b: np.ndarray) -> np.ndarray:
    """Big-endian unsigned integer of each row of bytes."""
    out = np.zeros(len(b), dtype=np.int64)
    for k in range(b.shape[1]):
        out = (out << 8) | b[:, k]
    return out


def _addresses(b: np.ndarray, ok: np.ndarray) -> np.ndarray:
    """Rows of 4 or 16 address bytes → strings, converting each distinct address once."""
    out = np.full(len(b), "", dtype=object)
    if not ok.any():
        return out
    rows = np.ascontiguousarray(b[ok])
    uniq, inv = np.unique(rows.view(f"V{rows.shape[1]}").ravel(), return_inverse=True)
    names = np.array([str(ipaddress.ip_address(u.tobytes())) for u in uniq], dtype=object)
    out[ok] = names[inv]
    return out


def read(path: str | Path, port: int = wire.DEFAULT_PORT) -> pd.DataFrame:
    path = Path(path)
    raw = path.read_bytes()
    if len(raw) < 24:
        raise PcapError(f"{path}: {len(raw)} bytes is no pcap/pcapng file")
    buf = np.frombuffer(raw, dtype=np.uint8)
    if raw[:4] in PCAP_MAGIC:
        data, cap, orig, ts = _records_pcap(buf, raw)
    elif struct.unpack_from("<I", raw)[0] == PCAPNG_SHB:
        data, cap, orig, ts = _records_pcapng(raw)
    else:
        raise PcapError(f"{path}: not a pcap or pcapng file (magic {raw[:4].hex()})")
    end = data + cap
    n = len(data)
    cols: dict[str, np.ndarray] = {"ts_ns": ts, "caplen": cap, "wirelen": orig}
    et_b, ok = _gather(buf, data + 12, end, 2)
    ethertype = np.where(ok, _be(et_b), -1)
    l3 = data + 14
    vlan = ethertype == 0x8100  # one 802.1Q tag
    if vlan.any():
        inner, ok2 = _gather(buf, data + 16, end, 2)
        ethertype = np.where(vlan & ok2, _be(inner), ethertype)
        l3 = np.where(vlan, data + 18, l3)
    cols["ethertype"] = ethertype
    v4, v6 = ethertype == 0x0800, ethertype == 0x86DD
    h4, ok4 = _gather(buf, l3, end, 20)
    h6, ok6 = _gather(buf, l3, end, 40)
    ok4 &= v4 & ((h4[:, 0] >> 4) == 4)
    ok6 &= v6 & ((h6[:, 0] >> 4) == 6)
    tos = np.where(ok4, h4[:, 1], np.where(ok6, ((h6[:, 0] & 0xF) << 4) | (h6[:, 1] >> 4), -1)).astype(np.int64)
    cols["ip"] = np.where(ok4, 4, np.where(ok6, 6, 0))
    cols["dscp"] = np.where(tos >= 0, tos >> 2, -1)
    cols["ecn"] = np.where(tos >= 0, tos & 3, -1)
    cols["ip_len"] = np.where(ok4, _be(h4[:, 2:4]), np.where(ok6, _be(h6[:, 4:6]), -1))
    proto = np.where(ok4, h4[:, 9], np.where(ok6, h6[:, 6], -1)).astype(np.int64)
    cols["proto"] = proto
    src = _addresses(h4[:, 12:16], ok4)
    dst = _addresses(h4[:, 16:20], ok4)
    src6, dst6 = _addresses(h6[:, 8:24], ok6), _addresses(h6[:, 24:40], ok6)
    cols["src"] = np.where(ok6, src6, src)
    cols["dst"] = np.where(ok6, dst6, dst)
    l4 = np.where(ok4, l3 + (h4[:, 0] & 0xF).astype(np.int64) * 4, np.where(ok6, l3 + 40, -1))
    udp_b, oku = _gather(buf, l4, end, 8)
    oku &= proto == 17
    tcp_b, okt = _gather(buf, l4, end, 4)
    okt &= proto == 6
    cols["sport"] = np.where(oku | okt, _be(np.where(oku[:, None], udp_b[:, 0:2], tcp_b[:, 0:2])), -1)
    cols["dport"] = np.where(oku | okt, _be(np.where(oku[:, None], udp_b[:, 2:4], tcp_b[:, 2:4])), -1)
    cols["udp_len"] = np.where(oku, _be(udp_b[:, 4:6]), -1)
    th, okh = _gather(buf, l4 + 8, end, wire.HEADER_LEN)
    okh &= oku & ((cols["dport"] == port) | (cols["sport"] == port))
    head = np.ascontiguousarray(th).view(wire.HEADER_DTYPE).reshape(n) if n else np.zeros(0, wire.HEADER_DTYPE)
    fields = wire.split_fields(head) if n else {name: np.zeros(0) for name, _ in wire.HEADER_FIELDS}
    okh &= (fields["magic"] == wire.MAGIC) & (fields["version"] == wire.VERSION)
    cols["trimlab"] = okh
    for name, width in wire.HEADER_FIELDS:
        v = fields[name]
        cols[name] = (np.where(okh, v.astype(np.float32), np.nan) if width == "f32"
                      else np.where(okh, v.astype(np.int64), -1))
    return pd.DataFrame(cols)
