"""A vectorized pcap / pcapng reader: the file is one numpy byte array; the walk from record
to record (each offset depends on the previous record's length) runs in a small C helper
(analysis/walk.c, compiled on first use; a Python loop where no compiler exists), and every
field is then gathered for all packets at once with fixed-width strided views.

    df = read("run/pcaps/w1.pcap")   # one row per packet

Columns: ts_ns, caplen, wirelen, ethertype, ip (4 | 6 | 0), dscp, ecn, ip_len (IPv4 total
length / IPv6 payload length, as the header says), proto, src, dst (categorical), sport, dport,
udp_len (as the header says), udp_payload (the UDP payload bytes the frame holds: a trimmed
packet's headers may still give its length before the cut), and, for
UDP packets to or from `port` whose capture holds the whole trimlab header, the header's
fields (magic … scale, from trimlab.wire.HEADER_FIELDS) plus `trimlab` (bool). Missing values
are -1 (NaN for scale and the addresses). scapy stays for declaring and dissecting the
protocol; `trimlab bench pcap` measures this reader against dpkt and tshark.
"""

from __future__ import annotations

import ctypes
import ipaddress
import struct
from functools import lru_cache
from pathlib import Path

import numpy as np
import pandas as pd

from trimlab import native, resources, wire
from trimlab.config import GRADIENT_PORT
from trimlab.errors import TrimlabError

LINKTYPE_ETHERNET = 1
PCAP_MAGIC = {b"\xd4\xc3\xb2\xa1": ("<", 1_000), b"\xa1\xb2\xc3\xd4": (">", 1_000),
              b"\x4d\x3c\xb2\xa1": ("<", 1), b"\xa1\xb2\x3c\x4d": (">", 1)}
PCAPNG_SHB = 0x0A0D0D0A
CHUNK = 1 << 20  # offsets per call of the walker
WALK_SOURCE = resources.c_source("analysis", "walk.c")


class PcapError(TrimlabError):
    """A capture file that is not pcap/pcapng, or not Ethernet."""


# -- the walk --------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _walker():
    """The compiled walker, or None (then the Python loop below does the same)."""
    try:
        lib = ctypes.CDLL(str(native.build(WALK_SOURCE, "gcc", ["-O2", "-shared", "-fPIC"], "walk", ".so")))
    except (TrimlabError, OSError):
        return None
    p_long, p_int = ctypes.POINTER(ctypes.c_long), ctypes.POINTER(ctypes.c_int)
    lib.pcap_walk.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int, p_long, ctypes.c_void_p, ctypes.c_long]
    lib.pcapng_walk.argtypes = [ctypes.c_void_p, ctypes.c_long, p_int, p_long, ctypes.c_void_p, ctypes.c_long]
    lib.pcap_walk.restype = lib.pcapng_walk.restype = ctypes.c_long
    return lib


def _walk(buf: np.ndarray, size: int, fmt: str, big_endian: bool = False, python: bool = False) -> np.ndarray:
    """Offsets of every whole pcap record (from byte 24) or pcapng block (from byte 0)."""
    lib = None if python else _walker()
    if lib is None:
        return _walk_python(buf[:size].tobytes(), fmt, big_endian)
    parts = []
    pos, swap = ctypes.c_long(24 if fmt == "pcap" else 0), ctypes.c_int(int(big_endian))
    while True:
        out = np.empty(CHUNK, dtype=np.int64)
        if fmt == "pcap":
            k = lib.pcap_walk(buf.ctypes.data, size, swap.value, ctypes.byref(pos), out.ctypes.data, CHUNK)
        else:
            k = lib.pcapng_walk(buf.ctypes.data, size, ctypes.byref(swap), ctypes.byref(pos), out.ctypes.data, CHUNK)
        parts.append(out[:k])
        if k < CHUNK:
            return np.concatenate(parts)


def _walk_python(raw: bytes, fmt: str, big_endian: bool) -> np.ndarray:
    offs = []
    if fmt == "pcap":
        incl = struct.Struct(">I" if big_endian else "<I").unpack_from
        n, end = 24, len(raw) - 16
        while n <= end:
            nxt = n + 16 + incl(raw, n + 8)[0]
            if nxt > len(raw):
                break
            offs.append(n)
            n = nxt
    else:
        n, order = 0, ">" if big_endian else "<"
        while n + 12 <= len(raw):
            if struct.unpack_from("<I", raw, n)[0] == PCAPNG_SHB:
                order = ">" if raw[n + 8] == 0x1A else "<"
            blen = struct.unpack_from(order + "I", raw, n + 4)[0]
            if blen < 12 or n + blen > len(raw):
                break
            offs.append(n)
            n += blen
    return np.asarray(offs, dtype=np.int64)


# -- gathering --------------------------------------------------------------------------------

def _rows(buf: np.ndarray, start: np.ndarray, width: int) -> np.ndarray:
    """(n, width) bytes buf[start : start + width] per row, in one gather through a strided
    view; rows that run past the end are zero-filled there (start < 0 reads from 0)."""
    start = np.maximum(start, 0)
    last = len(buf) - width  # the last start whose row lies wholly inside the file
    if last < 0:
        buf, last = np.concatenate([buf, np.zeros(width, np.uint8)]), len(buf)
    view = np.ndarray(shape=(last + 1,), dtype=f"V{width}", buffer=buf, strides=(1,))
    out = view[np.minimum(start, last)].view(np.uint8).reshape(len(start), width)
    for i in np.flatnonzero(start > last):  # at most `width` rows near the end of the file
        tail = buf[start[i]:].tobytes()
        out[i] = np.frombuffer(tail + bytes(width - len(tail)), np.uint8)
    return out


def _uint(cols: np.ndarray, order: str = ">") -> np.ndarray:
    """Unsigned integer of each row of 1, 2 or 4 bytes, in byte order `order`."""
    return np.ascontiguousarray(cols).view(f"{order}u{cols.shape[1]}").reshape(-1).astype(np.int64)


def _records_pcap(buf: np.ndarray, size: int, raw_head: bytes):
    order, ns_per_frac = PCAP_MAGIC[raw_head[:4]]
    link = struct.unpack_from(order + "I", raw_head, 20)[0]
    if link != LINKTYPE_ETHERNET:
        raise PcapError(f"linktype {link}: only Ethernet (1) captures are read")
    offs = _walk(buf, size, "pcap", order == ">")
    h = _rows(buf, offs, 16)
    sec, frac, incl, orig = (_uint(h[:, i:i + 4], order) for i in (0, 4, 8, 12))
    return offs + 16, incl, orig, sec * 1_000_000_000 + frac * ns_per_frac


def _records_pcapng(buf: np.ndarray, size: int):
    """Enhanced packet blocks of Ethernet interfaces; timestamps per interface resolution."""
    offs = _walk(buf, size, "pcapng")
    raw_type = _rows(buf, offs, 4)
    shb = np.flatnonzero(_uint(raw_type, "<") == PCAPNG_SHB)
    out = []
    for k, first in enumerate(shb):  # sections (normally one): own byte order, own interfaces
        sec = offs[first:shb[k + 1] if k + 1 < len(shb) else len(offs)]
        order = ">" if buf[sec[0] + 8] == 0x1A else "<"
        btype = _uint(_rows(buf, sec, 4), order)
        ifaces = [_interface(buf, int(o), order) for o in sec[btype == 1]]
        epb = sec[btype == 6]
        f = _rows(buf, epb + 8, 20)
        iface, hi, lo, cap, orig = (_uint(f[:, i:i + 4], order) for i in range(0, 20, 4))
        links = np.array([lk for lk, _ in ifaces] + [-1], dtype=np.int64)
        ns = np.array([t for _, t in ifaces] + [1_000], dtype=np.int64)
        iface = np.where(iface < len(ifaces), iface, len(ifaces))
        bad = links[iface] != LINKTYPE_ETHERNET
        if bad.any():
            j = int(iface[bad][0])
            raise PcapError(f"pcapng interface {j}: linktype {links[j]}; only Ethernet is read")
        out.append((epb + 28, cap, orig, ((hi << 32) | lo) * ns[iface]))
    if not out:
        return (np.zeros(0, dtype=np.int64),) * 4
    return tuple(np.concatenate(c) for c in zip(*out))


def _interface(buf: np.ndarray, n: int, order: str) -> tuple[int, int]:
    """(linktype, ns per timestamp tick) of an interface description block."""
    raw = buf[n:n + struct.unpack(order + "I", buf[n + 4:n + 8].tobytes())[0]].tobytes()
    link = struct.unpack_from(order + "H", raw, 8)[0]
    ns, p = 1_000, 16  # default resolution: microseconds
    while p + 4 <= len(raw) - 4:
        code, length = struct.unpack_from(order + "HH", raw, p)
        if code == 0:
            break
        if code == 9 and length >= 1:  # if_tsresol
            r = raw[p + 4]
            ns = (10 ** 9 // 10 ** r) if not r & 0x80 else max(1, int(1e9 / 2 ** (r & 0x7F)))
        p += 4 + (length + 3) // 4 * 4
    return link, ns


def _addresses(v4: np.ndarray, ok4: np.ndarray, v6: np.ndarray, ok6: np.ndarray) -> pd.Categorical:
    """Address bytes of each row (4 or 16, chosen by ok4/ok6) → categorical strings; each
    distinct address is converted once."""
    codes = np.full(len(ok4), -1, dtype=np.int64)
    names: list[str] = []
    for rows, ok, dtype in ((v4, ok4, ">u4"), (v6, ok6, "V16")):
        if not ok.any():
            continue
        keys = np.ascontiguousarray(rows[ok]).view(dtype).reshape(-1)
        uniq, inv = np.unique(keys, return_inverse=True)
        codes[ok] = inv.reshape(-1) + len(names)
        names += [str(ipaddress.ip_address(int(u) if dtype == ">u4" else u.tobytes())) for u in uniq]
    return pd.Categorical.from_codes(codes, categories=pd.Index(names, dtype=object)) if names else \
        pd.Categorical.from_codes(codes, categories=pd.Index(["-"], dtype=object))


def _load(path: Path) -> np.ndarray:
    """The file as a read-only memory map: only the pages that hold headers are touched."""
    if path.stat().st_size == 0:
        return np.zeros(0, dtype=np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def read(path: str | Path, port: int = GRADIENT_PORT) -> pd.DataFrame:
    path = Path(path)
    buf = _load(path)
    size = len(buf)
    head = buf[:24].tobytes()
    if size < 24:
        raise PcapError(f"{path}: {size} bytes is no pcap/pcapng file")
    if head[:4] in PCAP_MAGIC:
        data, cap, orig, ts = _records_pcap(buf, size, head)
    elif struct.unpack_from("<I", head)[0] == PCAPNG_SHB:
        data, cap, orig, ts = _records_pcapng(buf, size)
    else:
        raise PcapError(f"{path}: not a pcap or pcapng file (magic {head[:4].hex()})")
    return _dissect(buf, data, cap, orig, ts, port)


def _dissect(buf, data, cap, orig, ts, port) -> pd.DataFrame:
    n = len(data)
    cols: dict[str, object] = {"ts_ns": ts, "caplen": cap, "wirelen": orig}
    m = _rows(buf, data, 14 + 4 + 40)  # Ethernet, one 802.1Q tag, an IPv6 header
    within = lambda off, width: off + width <= cap  # noqa: E731  (the capture holds it)
    ethertype = np.where(within(12, 2), _uint(m[:, 12:14]), -1)
    vlan = (ethertype == 0x8100) & within(16, 2)
    ethertype = np.where(vlan, _uint(m[:, 16:18]), ethertype)
    cols["ethertype"] = ethertype
    l3 = np.where(vlan, 18, 14)
    ip = np.where(vlan[:, None], m[:, 18:58], m[:, 14:54])  # (n, 40) from the IP header on
    ok4 = (ethertype == 0x0800) & within(l3, 20) & ((ip[:, 0] >> 4) == 4)
    ok6 = (ethertype == 0x86DD) & within(l3, 40) & ((ip[:, 0] >> 4) == 6)
    tos = np.where(ok4, ip[:, 1], np.where(ok6, ((ip[:, 0] & 0xF) << 4) | (ip[:, 1] >> 4), -1)).astype(np.int64)
    cols["ip"] = np.where(ok4, 4, np.where(ok6, 6, 0))
    cols["dscp"] = np.where(tos >= 0, tos >> 2, -1)
    cols["ecn"] = np.where(tos >= 0, tos & 3, -1)
    cols["ip_len"] = np.where(ok4, _uint(ip[:, 2:4]), np.where(ok6, _uint(ip[:, 4:6]), -1))
    proto = np.where(ok4, ip[:, 9], np.where(ok6, ip[:, 6], -1)).astype(np.int64)
    cols["proto"] = proto
    cols["src"] = _addresses(ip[:, 12:16], ok4, ip[:, 8:24], ok6)
    cols["dst"] = _addresses(ip[:, 16:20], ok4, ip[:, 24:40], ok6)
    l4 = np.where(ok4, l3 + (ip[:, 0] & 0xF).astype(np.int64) * 4, np.where(ok6, l3 + 40, -1))
    t = _rows(buf, data + l4, 8 + wire.HEADER_LEN)  # UDP header and the trimlab header
    oku = (proto == 17) & (l4 >= 0) & within(l4, 8)
    okp = ((proto == 6) & (l4 >= 0) & within(l4, 4)) | oku
    cols["sport"] = np.where(okp, _uint(t[:, 0:2]), -1)
    cols["dport"] = np.where(okp, _uint(t[:, 2:4]), -1)
    cols["udp_len"] = np.where(oku, _uint(t[:, 4:6]), -1)
    # what the frame holds, not what its headers say: a real switch leaves a trimmed
    # packet's UDP and IP lengths as they were (Ethernet padding: the header's, shorter)
    cols["udp_payload"] = np.where(oku, np.minimum(orig.astype(np.int64) - l4, cols["udp_len"]) - wire.UDP_LEN, -1)
    okh = oku & within(l4 + 8, wire.HEADER_LEN) & ((cols["dport"] == port) | (cols["sport"] == port))
    head = np.ascontiguousarray(t[:, 8:]).view(wire.HEADER_DTYPE).reshape(n)
    fields = wire.split_fields(head)
    okh &= (fields["magic"] == wire.MAGIC) & (fields["version"] == wire.VERSION)
    cols["trimlab"] = okh
    for name, width in wire.HEADER_FIELDS:
        v = fields[name]
        cols[name] = (np.where(okh, v.astype(np.float32), np.nan) if width == "f32"
                      else np.where(okh, v.astype(np.int64), -1))
    wide = {"ts_ns", "step", "src", "dst", "trimlab", "scale"}  # the rest fit 32 bits (half the memory)
    return pd.DataFrame({k: v if k in wide else v.astype(np.int32) for k, v in cols.items()})
