"""The trimlab packet: a 24-byte header that survives any trim, then the codec's body.

UDP (default port 47000) over IPv4 or IPv6. The header is declared once, in
HEADER_FIELDS (network byte order); the numpy dtype used for bulk (de)packetizing and
the scapy layer (trimlab.scapy_layer) are both derived from it.

A switch trim size S counts from the first byte of the Ethernet header (FCS excluded),
so a trimmed packet keeps S − 14 − 20|40 − 8 − 24 bytes of body.
"""

from __future__ import annotations

import collections
import struct
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from trimlab.errors import WireError

MAGIC = 0xA
VERSION = 1
ETH_LEN, IPV4_LEN, IPV6_LEN, UDP_LEN = 14, 20, 40, 8

# (name, width): width in bits, or "f32" for an IEEE-754 float. Order is wire order.
HEADER_FIELDS: tuple[tuple[str, int | str], ...] = (
    ("magic", 4),     # 0xA
    ("version", 4),   # VERSION
    ("codec", 4),     # codec id (trimlab.codec.BY_ID)
    ("flags", 4),     # 0x1 unbiased, 0x2 rotated
    ("planes", 8),    # K: bit planes (embedded), bits per value (raw, sign_tail)
    ("packet", 8),    # packet index within its span
    ("job", 16),      # job id: receivers accept only their own
    ("step", 32),     # training step
    ("rank", 16),     # sender rank
    ("bucket", 16),   # bucket / shard id
    ("span", 16),     # span index within the bucket
    ("coords", 16),   # coordinates B carried by this packet
    ("length", 16),   # UDP payload bytes as sent (header included): reveals a trim
    ("scale", "f32"),  # per-packet scale (σ for embedded, the 1-bit scale for sign_tail)
)


def _numpy_dtype() -> np.dtype:
    """Byte-aligned numpy view of HEADER_FIELDS; two 4-bit fields share one byte."""
    fields, nibbles = [], []
    for name, width in HEADER_FIELDS:
        if width == 4:
            nibbles.append(name)
            if len(nibbles) == 2:
                fields.append(("_".join(nibbles), "u1"))
                nibbles = []
        else:
            fields.append((name, ">f4" if width == "f32" else {8: "u1", 16: ">u2", 32: ">u4"}[width]))
    return np.dtype(fields)


HEADER_DTYPE = _numpy_dtype()
HEADER_LEN = HEADER_DTYPE.itemsize
assert HEADER_LEN == 24
# the same layout for one packet at a time: one C call instead of a numpy view per field
_STRUCT = struct.Struct("!" + "".join({"|u1": "B", ">u2": "H", ">u4": "I", ">f4": "f"}[HEADER_DTYPE.fields[n][0].str]
                                     for n in HEADER_DTYPE.names))
assert _STRUCT.size == HEADER_LEN


def ip_udp_overhead(ipv6: bool = False) -> int:
    return (IPV6_LEN if ipv6 else IPV4_LEN) + UDP_LEN


def min_trim_size(ipv6: bool = False) -> int:
    """The smallest trim size that keeps the whole trimlab header."""
    return ETH_LEN + ip_udp_overhead(ipv6) + HEADER_LEN


def kept_body_bytes(trim_size: int, ipv6: bool = False) -> int:
    """Body bytes left after a trim to `trim_size` (may be negative: header cut)."""
    return trim_size - min_trim_size(ipv6)


def max_coords(codec, mtu: int, ipv6: bool = False) -> int:
    """The largest B (a multiple of 32) whose packets fit the MTU."""
    room = mtu - ip_udp_overhead(ipv6) - HEADER_LEN
    per32 = codec.body_bytes(32)
    return (room // per32) * 32 if room > 0 else 0


def fill_coords(codec, mtu: int, span: int, ipv6: bool = False) -> int:
    """B when a run does not set it: as many as fit the MTU, at most one span (jumbo frames
    hold more than 4096 coordinates of some codecs)."""
    return min(max_coords(codec, mtu, ipv6), span)


@dataclass(frozen=True)
class PacketIds:
    """Who sent a bucket and which one: everything in the header but the layout."""

    job: int = 0
    step: int = 0
    rank: int = 0
    bucket: int = 0

    def __post_init__(self):
        for name, bits in (("job", 16), ("step", 32), ("rank", 16), ("bucket", 16)):
            value = getattr(self, name)
            if not 0 <= value < 1 << bits:
                raise WireError(f"packet id {name}={value} does not fit the header's "
                                f"{bits}-bit field (0..{(1 << bits) - 1})")


@dataclass(frozen=True)
class Header:
    magic: int
    version: int
    codec: int
    flags: int
    planes: int
    packet: int
    job: int
    step: int
    rank: int
    bucket: int
    span: int
    coords: int
    length: int
    scale: float


def split_fields(arr: np.ndarray) -> dict[str, np.ndarray]:
    """Structured header array → one array per HEADER_FIELDS name."""
    out = {}
    for name in arr.dtype.names:
        if "_" in name:
            hi, lo = name.split("_")
            out[hi], out[lo] = arr[name] >> 4, arr[name] & 0xF
        else:
            out[name] = arr[name]
    return out


def parse_header(payload: bytes) -> Header:
    """The header of one UDP payload; WireError when it is short or not ours."""
    if len(payload) < HEADER_LEN:
        raise WireError(f"packet of {len(payload)} bytes is shorter than the {HEADER_LEN}-byte "
                        f"trimlab header; a trim size must keep at least the whole header")
    mv, cf, *rest = _STRUCT.unpack_from(payload)
    head = Header(mv >> 4, mv & 0xF, cf >> 4, cf & 0xF, *rest)
    if head.magic != MAGIC or head.version != VERSION:
        raise WireError(f"not a trimlab v{VERSION} packet (magic {head.magic:#x}, "
                        f"version {head.version})")
    return head


def _check_layout(codec, mtu: int, coords: int | None, span: int, ipv6: bool) -> int:
    best = max_coords(codec, mtu, ipv6)
    if best < 32:
        raise WireError(f"mtu={mtu} leaves no room for 32 coordinates of codec {codec.name}")
    if coords is None:
        return min(best, span)
    if coords > best:
        raise WireError(f"coords={coords} does not fit mtu={mtu} with codec {codec.name} "
                        f"({'IPv6' if ipv6 else 'IPv4'}); at most {best}")
    return coords


@dataclass
class Frames:
    """A bucket's UDP payloads as one array: row i is payload i, its first `length[i]` bytes
    (rows of full length are back to back in memory, so a run of them is one buffer)."""

    data: np.ndarray  # (n, width) uint8
    length: np.ndarray  # (n,) int64

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def payloads(self) -> list[bytes]:
        return [self.data[i, :self.length[i]].tobytes() for i in range(len(self))]


def packetize_frames(grad, codec, mtu: int = 1500, coords: int | None = None, span: int = 4096,
                     ids: PacketIds = PacketIds(), seed: int = 0, ipv6: bool = False) -> Frames:
    """Encode a gradient bucket into UDP payloads (header + body) that fit the MTU."""
    import torch  # heavy, as trimlab.codec: wire's header helpers start without them

    from trimlab.codec import CodecContext

    coords = _check_layout(codec, mtu, coords, span, ipv6)
    ctx = CodecContext(seed=seed, step=ids.step, bucket=ids.bucket, span=span, coords=coords)
    n, width = codec.body_shape(grad.numel(), ctx)
    frames = np.empty((n, HEADER_LEN + width), dtype=np.uint8)
    pk = codec.encode(grad, ctx, body=torch.from_numpy(frames)[:, HEADER_LEN:])  # bodies in place
    length = pk.length.cpu().numpy()
    head = np.zeros(n, dtype=HEADER_DTYPE)
    head["magic_version"] = (MAGIC << 4) | VERSION
    head["codec_flags"] = (codec.codec_id << 4) | codec.flags
    head["planes"] = codec.planes & 0xFF
    head["packet"] = pk.index.cpu().numpy()
    head["job"], head["step"], head["rank"], head["bucket"] = ids.job, ids.step, ids.rank, ids.bucket
    head["span"] = pk.span.cpu().numpy()
    head["coords"] = pk.coords.cpu().numpy()
    head["length"] = HEADER_LEN + length
    head["scale"] = pk.scale.cpu().numpy()
    frames[:, :HEADER_LEN] = head.view(np.uint8).reshape(n, HEADER_LEN)
    return Frames(frames, (HEADER_LEN + length).astype(np.int64))


def packetize(grad, codec, mtu: int = 1500, coords: int | None = None, span: int = 4096,
              ids: PacketIds = PacketIds(), seed: int = 0, ipv6: bool = False) -> list[bytes]:
    """`packetize_frames` as one bytes object per payload."""
    return packetize_frames(grad, codec, mtu, coords, span, ids, seed, ipv6).payloads()


@dataclass
class Depacketized:
    decoded: object  # trimlab.codec.Decoded
    packets: object  # trimlab.codec.Packets: what was accepted, body lengths as received
    sent_length: np.ndarray  # (P,) UDP payload bytes as sent, per accepted packet
    discarded: collections.Counter  # reason -> count

    @property
    def trimmed(self) -> np.ndarray:
        return self.packets.length.cpu().numpy() + HEADER_LEN < self.sent_length


def depacketize(payloads: Iterable[bytes], codec, numel: int, ids: PacketIds,
                span: int = 4096, coords: int = 1024, seed: int = 0,
                device: str = "cpu") -> Depacketized:
    """Decode one sender's bucket from the UDP payloads that arrived (any order, possibly
    trimmed). Packets of other jobs, steps, buckets or senders, malformed ones and
    duplicates are counted in `discarded`, never raised: a flood of garbage degrades
    nothing but the counters. A packet is missing when it never arrived."""
    import torch  # heavy: wire's header helpers start without it

    from trimlab.codec import CodecContext, Packets  # heavy (torch), as above

    discarded: collections.Counter = collections.Counter()
    kept = []
    for p in payloads:
        if len(p) < HEADER_LEN:
            discarded["short"] += 1
        else:
            kept.append(p)
    ctx = CodecContext(seed=seed, step=ids.step, bucket=ids.bucket, span=span, coords=coords)
    lay = codec.layout(numel, ctx)
    n = len(kept)
    head = np.frombuffer(b"".join(p[:HEADER_LEN] for p in kept), dtype=HEADER_DTYPE, count=n)
    f = split_fields(head)
    got = np.array([len(p) for p in kept], dtype=np.int64)
    ok, slot, _ = screen(f, got, codec, lay, ids, discarded)
    idx = np.flatnonzero(ok)
    _, first = np.unique(slot[idx], return_index=True)
    discarded["duplicate"] += int(len(idx) - len(first))
    idx = idx[np.sort(first)]
    width = int(max((_body_bytes(codec, f["coords"][idx]).max() if len(idx) else 0), 0))
    body = np.zeros((len(idx), width), dtype=np.uint8)
    for row, i in enumerate(idx):
        raw = kept[i][HEADER_LEN:HEADER_LEN + width]
        body[row, :len(raw)] = np.frombuffer(raw, dtype=np.uint8)
    def t(a, dtype="int64"):  # header fields are big-endian: convert to native first
        return torch.from_numpy(np.ascontiguousarray(a, dtype=dtype)).to(device)

    packets = Packets(span=t(f["span"][idx]), index=t(f["packet"][idx]), coords=t(f["coords"][idx]),
                      scale=t(f["scale"][idx], "float32"), body=t(body, "uint8"),
                      length=t(got[idx] - HEADER_LEN))
    decoded = codec.decode(packets, ctx, numel)
    return Depacketized(decoded, packets, f["length"][idx].astype(np.int64),
                        +discarded)


def screen(f: dict[str, np.ndarray], got: np.ndarray, codec, lay, ids: PacketIds,
           discarded: collections.Counter, ranks: np.ndarray | None = None,
           among: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Which packets (header fields `f`, `got` bytes received) belong to the bucket `ids`
    names and fit its layout `lay`: a mask, each packet's slot in the layout (-1 where it
    has none) and each rejected packet's reason ("" for the others), counted in
    `discarded`. `ranks`: the senders accepted, when more than `ids.rank`; `among`: only
    these packets are screened (the rest are neither accepted nor counted)."""
    slot, expect_coords = layout_slots(lay, f["span"], f["packet"])
    ranks = np.asarray([ids.rank] if ranks is None else ranks)
    checks = [
        ("not_trimlab", (f["magic"] != MAGIC) | (f["version"] != VERSION)),
        ("other_job", f["job"] != ids.job),
        ("other_codec", (f["codec"] != codec.codec_id) | (f["flags"] != codec.flags)
         | (f["planes"] != (codec.planes & 0xFF))),
        ("other_stream", (f["step"] != ids.step) | (f["bucket"] != ids.bucket) | ~np.isin(f["rank"], ranks)),
        ("bad_layout", (slot < 0) | (expect_coords != f["coords"])),  # (no slot: even if it claims 0 coords)
        ("bad_length", (f["length"] != HEADER_LEN + _body_bytes(codec, f["coords"]))
         | (got > f["length"])),
    ]
    ok = np.ones(len(got), dtype=bool) if among is None else among.copy()
    if not (np.logical_or.reduce([bad for _, bad in checks]) & ok).any():  # the usual case
        return ok, slot, constant_column("", len(got))
    why = np.full(len(got), "", dtype=object)
    for reason, bad in checks:
        bad = bad & ok
        discarded[reason] += int(bad.sum())
        why[bad] = reason
        ok &= ~bad
    return ok, slot, why


_COLUMNS: dict[str, np.ndarray] = {}


def constant_column(value: str, n: int) -> np.ndarray:
    """n times `value` as an object array, read-only: a view of one shared array, so that
    a batch with nothing to report builds no column of strings."""
    col = _COLUMNS.get(value)
    if col is None or len(col) < n:
        col = _COLUMNS[value] = np.full(max(n, 1024, 2 * len(col) if col is not None else 0), value, dtype=object)
        col.flags.writeable = False
    return col[:n]


def layout_slots(lay, span: np.ndarray, packet: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each packet's position in the layout's packet order (`Layout.skeleton`'s; -1 where
    the layout has no such packet) and the coordinates the layout puts in it (0 there)."""
    slot = np.full(len(span), -1, dtype=np.int64)
    coords = np.zeros(len(span), dtype=np.int64)
    span, packet, first = span.astype(np.int64), packet.astype(np.int64), 0
    for b in lay.blocks:
        g = b.group
        hit = ((span >= g.first) & (span < g.first + g.count)
               & (packet >= b.first_index) & (packet < b.first_index + b.per_span))
        slot[hit] = first + (span[hit] - g.first) * b.per_span + packet[hit] - b.first_index
        coords[hit] = b.coords
        first += g.count * b.per_span
    return slot, coords


def _body_bytes(codec, coords: np.ndarray) -> np.ndarray:
    return (codec.body_bytes(32) * coords.astype(np.int64)) // 32
