"""The gradient receiver's per-batch work: `route` a recvmmsg batch (each datagram's peer,
its header's fields, the node's checks) and `place` a collector's share of it (the
bucket's checks, duplicates, each body into its slot).

Two implementations leave the same state, statuses and counters: native (rx.c, built by
trimlab.native at first use, through ctypes, which releases the GIL) and the numpy
reference below. A batch costs numpy some 80 array operations whatever its size, which at
a thousand datagrams is most of the receiver's time outside the kernel and the decoder;
rx.c does it in one pass. `TRIMLAB_RX_IMPL=numpy` turns the native one off (`native`
makes its absence an error)."""

from __future__ import annotations

import collections
import ctypes
import functools
import os
import sys
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from trimlab import native, resources, wire
from trimlab.errors import TrimlabError

from trimlab.agents.context import NodeContext
from trimlab.agents.transport import Batch
from trimlab.codec import Layout

@dataclass
class Arrived:
    """Gradient datagrams that passed the node's checks (known source, trimlab, this job),
    with their parsed header fields; `data` rows are the datagrams from byte 0."""

    data: np.ndarray  # (n, slot) uint8
    length: np.ndarray  # (n,) int64: bytes received
    dscp: np.ndarray  # (n,) int64, -1 if unknown
    peer: np.ndarray  # (n,) int64: index into the node's peer addresses
    head: dict[str, np.ndarray]  # the header's fields (rx.FIELDS and scale), one column each
    time_ns: int
    cols: np.ndarray | None = None  # rx.route's columns of the fields, when native

    def take(self, rows: np.ndarray) -> "Arrived":
        """The datagrams at `rows`, copied (a receive buffer is reused by the next batch)."""
        return Arrived(self.data[rows], self.length[rows], self.dscp[rows], self.peer[rows],
                       {k: v[rows] for k, v in self.head.items()}, self.time_ns,
                       None if self.cols is None else self.cols[rows])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())


class Slots(Protocol):
    """What `place` fills: a collector's per-rank arrays of one (step, bucket), with the
    layout and the expected senders they are checked against."""

    node_ctx: NodeContext
    step: int
    bucket: int
    layout: Layout
    order: list[int]  # row -> rank
    rank_peer: np.ndarray  # row -> the rank's peer index
    expected: int  # packets per rank
    width: int  # bytes of the widest body
    body: np.ndarray  # (ranks, expected, width) uint8
    got: np.ndarray  # (ranks, expected) body bytes received, -1: none yet
    scale: np.ndarray
    sent: np.ndarray
    received: np.ndarray  # (ranks,) packets received
    native: tuple | None  # rx.c's description of the arrays, made at the first batch


# statuses, as rx.c numbers them: the node's checks, then the collector's (wire.screen's)
REASONS = ("accepted", "unknown_source", "not_trimlab", "other_job", "rank_mismatch", "other_codec",
           "other_stream", "bad_layout", "bad_length", "duplicate")
CODE = {r: i for i, r in enumerate(REASONS)}
_REASON_COLUMN = np.array(REASONS, dtype=object)
# the header's fields as rx.c parses them into columns (wire.HEADER_FIELDS, scale apart)
FIELDS = ("magic", "version", "codec", "flags", "planes", "packet", "job", "step", "rank", "bucket",
          "span", "coords", "length")
FLAGS = ["-O3", "-shared", "-fPIC"]  # trimlab.native adds the vector level this CPU runs
# where rx.c reads each header field (wire.HEADER_DTYPE's names): checked when it loads
_RX_C_OFFSETS = {"magic_version": 0, "codec_flags": 1, "planes": 2, "packet": 3, "job": 4, "step": 6, "rank": 10,
                 "bucket": 12, "span": 14, "coords": 16, "length": 18, "scale": 20}


@dataclass
class Routed:
    """A batch's datagrams after the node's checks."""

    peer: np.ndarray  # (n,) int64: index into the node's peer addresses, -1 for none
    head: dict[str, np.ndarray]  # FIELDS and "scale", one column each
    status: np.ndarray  # (n,) int8: CODE; 0 for those that passed
    passed: int
    cols: np.ndarray | None = None  # (n, len(FIELDS)) int64: the native route's columns


def mode() -> str:
    m = os.environ.get("TRIMLAB_RX_IMPL", "auto")
    if m not in ("auto", "native", "numpy"):
        raise TrimlabError(f"TRIMLAB_RX_IMPL={m!r}: choose auto, native or numpy")
    return m


class _Collector(ctypes.Structure):
    """rx.c's collector_t."""

    _fields_ = [(n, ctypes.c_int64) for n in ("job", "step", "bucket", "codec", "flags", "planes", "body_per32",
                                              "nranks", "expected", "width", "nblocks")] + \
               [(n, ctypes.c_void_p) for n in ("ranks", "rank_peer", "blocks", "body", "got", "sent", "received",
                                               "scale")]


@functools.lru_cache(maxsize=1)
def _lib():
    if sys.byteorder != "little":
        raise native.BuildError("rx.c needs a little-endian host")
    lib, _ = native.load_library(resources.c_source("agents", "rx.c"), "rx", FLAGS)
    if lib.tl_rx_nfields() != len(FIELDS) or lib.tl_rx_collector_size() != ctypes.sizeof(_Collector):
        raise native.BuildError("rx.c and trimlab.agents.rx disagree on the header columns or the collector")
    offsets = {name: wire.HEADER_DTYPE.fields[name][1] for name in wire.HEADER_DTYPE.names}
    if offsets != _RX_C_OFFSETS:
        raise native.BuildError(f"rx.c reads the header at {_RX_C_OFFSETS}, wire.HEADER_FIELDS has {offsets}")
    P, I = ctypes.c_void_p, ctypes.c_int64
    lib.tl_rx_route.argtypes = [P, I, P, P, P, I, P, I, I, P, P, P, P, P]
    lib.tl_rx_place.argtypes = [P, P, I, I, P, P, P, P, P, I, P, P, P]
    lib.tl_rx_route.restype = lib.tl_rx_place.restype = I
    return lib


@functools.lru_cache(maxsize=1)
def _available() -> bool:
    try:
        _lib()
        return True
    except native.BuildError:
        return False


def implementation() -> str:
    """'native' or 'numpy': what routes and places batches in this process."""
    m = mode()
    if m == "native":
        _lib()  # raises BuildError, naming the missing compiler
        return "native"
    return "native" if m == "auto" and _available() else "numpy"


def count(discarded, counts: np.ndarray) -> None:
    """Add per-status counts (indexed by CODE) to a Counter of reasons."""
    for code in np.flatnonzero(counts[1:]) + 1:
        discarded[REASONS[code]] += int(counts[code])


def status_column(status: np.ndarray) -> np.ndarray:
    """Statuses as the packet log's strings (one shared column when all were accepted)."""
    if not status.any():
        return wire.constant_column("accepted", len(status))
    return _REASON_COLUMN[status]


# -- route ---------------------------------------------------------------------------------
def route(b: "Batch", peers: np.ndarray, job: int, counts: np.ndarray) -> Routed:
    """Each datagram's peer (rows of `peers`, packed addresses), header fields, and the node's
    checks: a known source, a whole trimlab header, this job."""
    if implementation() == "native":
        return _route_native(b, peers, job, counts)
    return _route_numpy(b, peers, job, counts)


def _route_numpy(b, peers, job, counts) -> Routed:
    n = len(b)
    match = (b.addr[:, None, :] == peers[None]).all(2)
    peer = np.where(match.any(1), match.argmax(1), -1) if len(peers) else np.full(n, -1)
    # a copy, always (ascontiguousarray would give a view of the receive buffer for a
    # batch of one): the collectors' packet logs keep these fields past the next batch
    head = wire.split_fields(b.data[:, :wire.HEADER_LEN].copy().view(wire.HEADER_DTYPE)[:, 0])
    status = np.zeros(n, dtype=np.int8)
    for reason, bad in (("unknown_source", peer < 0),
                        ("not_trimlab", (b.length < wire.HEADER_LEN) | b.truncated | (head["magic"] != wire.MAGIC)
                         | (head["version"] != wire.VERSION)),
                        ("other_job", head["job"] != job)):
        bad = bad & (status == 0)
        status[bad] = CODE[reason]
    counts += np.bincount(status, minlength=len(REASONS))
    counts[0] = 0
    return Routed(peer, head, status, int((status == 0).sum()))


def _route_native(b, peers, job, counts) -> Routed:
    n = len(b)
    data = b.data
    if data.strides[1] != 1:
        raise ValueError("rx.route: datagram rows must be contiguous bytes")
    peer = np.empty(n, dtype=np.int64)
    cols = np.empty((n, len(FIELDS)), dtype=np.int64)
    scale = np.empty(n, dtype=np.float32)
    status = np.empty(n, dtype=np.int8)
    length = np.ascontiguousarray(b.length, dtype=np.int64)
    trunc = np.ascontiguousarray(b.truncated, dtype=np.uint8)
    addr = np.ascontiguousarray(b.addr, dtype=np.uint8)
    table = np.ascontiguousarray(peers, dtype=np.uint8)
    passed = _lib().tl_rx_route(data.ctypes.data, data.strides[0], length.ctypes.data, trunc.ctypes.data,
                                addr.ctypes.data, n, table.ctypes.data, len(table), job, peer.ctypes.data,
                                cols.ctypes.data, scale.ctypes.data, status.ctypes.data, counts.ctypes.data)
    head = {f: cols[:, i] for i, f in enumerate(FIELDS)}
    head["scale"] = scale
    return Routed(peer, head, status, int(passed), cols)


# -- place ---------------------------------------------------------------------------------
def place(coll: Slots, a: Arrived, rows: np.ndarray | None,
          counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The datagrams `rows` of `a` (None: all) into `coll`: each one's status (CODE) and, if
    it was accepted, its slot key (rank row × packets per rank + slot), else -1. Rejections
    are added to `counts`. Bytes past a body's length are copied too: every decoder reads a
    body only up to its length."""
    if implementation() == "native":
        return _place_native(coll, a, rows, counts)
    return _place_numpy(coll, a, rows, counts)


def _place_numpy(coll, a, rows, counts):
    if rows is not None:
        a = a.take(rows)
    f, n = a.head, len(a.length)
    order = np.asarray(coll.order)
    row = np.minimum(np.searchsorted(order, f["rank"].astype(np.int64)), len(order) - 1)
    known = (order[row] == f["rank"]) & (coll.rank_peer[row] == a.peer)
    status = np.where(known, 0, CODE["rank_mismatch"]).astype(np.int8)
    ids = wire.PacketIds(coll.node_ctx.job, coll.step, 0, coll.bucket)
    ok, slot, reason = wire.screen(f, a.length, coll.node_ctx.codec, coll.layout, ids, collections.Counter(),
                                   ranks=order, among=known)
    bad = known & ~ok
    for r in set(reason[bad].tolist()):  # (screen's reasons, as codes)
        status[bad & (reason == r)] = CODE[r]
    ok &= known
    # duplicates: a slot already filled, or filled earlier in this batch (the first wins)
    key = row * max(coll.expected, 1) + slot
    dup = ok & (coll.got[row, np.maximum(slot, 0)] >= 0)
    if ok.any():
        okey = key[ok]
        if (np.diff(okey) <= 0).any():  # (ascending keys, the usual case, cannot repeat)
            first = np.zeros(n, dtype=bool)
            first[np.flatnonzero(ok)[np.unique(okey, return_index=True)[1]]] = True
            dup |= ok & ~first
    status[dup] = CODE["duplicate"]
    accept = ok & ~dup
    take = np.flatnonzero(accept)
    if len(take):
        r, s = row[take], slot[take]
        src = a.data[:, wire.HEADER_LEN:wire.HEADER_LEN + coll.width]
        k, w = len(take), src.shape[1]
        if take[-1] - take[0] == k - 1 and (r == r[0]).all() and (np.diff(s) == 1).all():
            coll.body[r[0], s[0]:s[0] + k, :w] = src[take[0]:take[0] + k]  # a run: one strided copy
        else:
            coll.body[r, s, :w] = src[take]
        coll.got[r, s] = a.length[take] - wire.HEADER_LEN
        coll.scale[r, s] = f["scale"][take]
        coll.sent[r, s] = f["length"][take]
        coll.received += np.bincount(r, minlength=len(coll.received))
    counts += np.bincount(status, minlength=len(REASONS))
    counts[0] = 0
    return status, np.where(accept, key, -1)


def _place_native(coll, a, rows, counts):
    if coll.native is None:  # the collector's description for rx.c, once (it points into its arrays)
        coll.native = _describe(coll)
    k = coll.native
    cols = a.cols if a.cols is not None else np.stack([np.asarray(a.head[f], dtype=np.int64) for f in FIELDS], 1)
    scale = np.ascontiguousarray(a.head["scale"], dtype=np.float32)
    length = np.ascontiguousarray(a.length, dtype=np.int64)
    peer = np.ascontiguousarray(a.peer, dtype=np.int64)
    n = len(length) if rows is None else len(rows)
    status = np.empty(n, dtype=np.int8)
    key = np.empty(n, dtype=np.int64)
    rows = None if rows is None else np.ascontiguousarray(rows, dtype=np.int64)
    if a.data.strides[1] != 1:
        raise ValueError("rx.place: datagram rows must be contiguous bytes")
    _lib().tl_rx_place(ctypes.byref(k[0]), a.data.ctypes.data, a.data.strides[0], a.data.shape[1],
                       length.ctypes.data, peer.ctypes.data, cols.ctypes.data, scale.ctypes.data,
                       None if rows is None else rows.ctypes.data, n, status.ctypes.data,
                       key.ctypes.data, counts.ctypes.data)
    return status, key


def _describe(coll) -> tuple:
    codec = coll.node_ctx.codec
    blocks = np.array([[b.group.first, b.group.count, b.first_index, b.per_span, b.coords]
                       for b in coll.layout.blocks], dtype=np.int64).reshape(-1, 5)
    ranks = np.asarray(coll.order, dtype=np.int64)
    rank_peer = np.ascontiguousarray(coll.rank_peer, dtype=np.int64)
    for a in (coll.body, coll.got, coll.sent, coll.received, coll.scale):
        assert a.flags.c_contiguous
    k = _Collector(job=coll.node_ctx.job, step=coll.step, bucket=coll.bucket, codec=codec.codec_id,
                   flags=codec.flags, planes=codec.planes & 0xFF, body_per32=codec.body_bytes(32),
                   nranks=len(ranks), expected=coll.expected, width=coll.width, nblocks=len(blocks),
                   ranks=ranks.ctypes.data, rank_peer=rank_peer.ctypes.data, blocks=blocks.ctypes.data,
                   body=coll.body.ctypes.data, got=coll.got.ctypes.data, sent=coll.sent.ctypes.data,
                   received=coll.received.ctypes.data, scale=coll.scale.ctypes.data)
    return k, ranks, rank_peer, blocks  # the arrays stay alive with the description
