"""Gradient collection (the gradient port, trimmable DSCP): a `Collector` gathers one
(step, bucket) from the expected ranks until every packet arrived or the deadline passed,
then decodes each rank's packets at whatever precision arrived and averages per coordinate
over the contributions that arrived.

Packets come in batches (`Arrived`: one recvmmsg's datagrams of this bucket, as arrays);
each body is copied once, straight into its slot of the rank's body array in the layout's
packet order, which is what the codec decodes. No per-packet Python on this path."""

from __future__ import annotations

import time
from dataclasses import dataclass
import numpy as np
import torch

from trimlab import wire
from trimlab.agents import rx
from trimlab.agents.context import NodeContext
from trimlab.agents.rx import Arrived
from trimlab.codec import CodecContext, Packets
from trimlab.config import PACKET_LOG_FIELDS



@dataclass
class Reduced:
    mean: torch.Tensor  # averaged gradient, 0 where no contribution arrived
    min_contributors: int  # the fewest contributions averaged at any coordinate
    packets: int
    trimmed: int
    expected: int
    missing: int  # packets never received (lost or after the deadline)
    per_rank: dict[int, int]  # rank -> packets received


def _units(flat: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`flat` as (whole units, unit) rows, and the shorter last unit (may be empty): views."""
    n = flat.numel() // unit * unit
    return flat[:n].view(-1, unit), flat[n:]


def _zero_units(flat: torch.Tensor, unit: int, miss: torch.Tensor) -> None:
    rows, tail = _units(flat, unit)
    rows.index_fill_(0, miss[:len(rows)].nonzero().squeeze(1), 0)
    if tail.numel() and bool(miss[-1]):
        tail.zero_()


def _divide_units(flat: torch.Tensor, unit: int, count: torch.Tensor) -> None:
    rows, tail = _units(flat, unit)
    rows.div_(count[:len(rows), None])
    if tail.numel():
        tail.div_(count[-1])


class Collector:
    """Gradient packets of one (step, bucket) from the expected ranks."""

    def __init__(self, node_ctx: NodeContext, step: int, bucket: int, ranks: dict[int, str], numel: int,
                 deadline_s: float):
        self.node_ctx, self.step, self.bucket, self.ranks, self.numel = node_ctx, step, bucket, ranks, numel
        n = node_ctx
        self.ctx = CodecContext(seed=n.seed, step=step, bucket=bucket, span=n.span, coords=n.coords)
        self.layout = n.codec.layout(numel, self.ctx)
        span, index, coords, body = n.codec.skeleton(self.layout)  # (cached: the same every step)
        self.slot_span, self.slot_index, self.slot_coords = span, index, coords
        self.expected = len(span)  # packets per rank
        self.width = int(body.max()) if len(body) else 0
        self.order = sorted(ranks)  # rank -> row of the arrays below
        self.rank_peer = np.array([n.peer_index(ranks[r]) for r in self.order], dtype=np.int64)
        nr = len(self.order)
        # not cleared: only a slot that came is decoded, and only up to its length (and a
        # fresh 2 MB of zeros costs a step 3–4 % of the receive rate in page faults)
        self.body = np.empty((nr, self.expected, self.width), dtype=np.uint8)
        self.got = np.full((nr, self.expected), -1, dtype=np.int64)  # body bytes received, -1: none yet
        self.scale = np.zeros((nr, self.expected), dtype=np.float32)
        self.sent = np.zeros((nr, self.expected), dtype=np.int64)  # UDP payload bytes as sent
        self.received = np.zeros(nr, dtype=np.int64)
        self._log: list[tuple] = []  # (batch, its rows, their statuses and slot keys), batch by batch
        self.native: tuple | None = None  # rx.c's description of this collector, at its first batch
        self.deadline_s = deadline_s
        self.opened = time.monotonic()
        self.first: float | None = None

    def add(self, a: Arrived, rows: np.ndarray | None = None) -> None:
        """Take a batch of this bucket's datagrams (those at `rows`, or all): check them
        against the layout and the expected senders, drop duplicates, copy each body into
        its slot (rx.place), and log them."""
        counts = np.zeros(len(rx.REASONS), dtype=np.int64)
        status, key = rx.place(self, a, rows, counts)
        rx.count(self.node_ctx.discarded, counts)
        if self.first is None and self.received.any():
            self.first = time.monotonic()
        # the log is built when asked for (rows): here only what it needs is kept
        self._log.append((a, rows, status, key))

    @property
    def missing(self) -> int:
        """Packets not yet received."""
        return self.expected * len(self.order) - int(self.received.sum())

    @property
    def complete(self) -> bool:
        return bool((self.received >= self.expected).all())

    def expired(self, now: float) -> bool:
        return self.first is not None and now - self.first > self.deadline_s

    def reduce(self, local: torch.Tensor | None = None) -> Reduced:
        """Decode every rank's packets, average per coordinate over what arrived; `local` is
        an exact contribution that never crossed the network (a shard owner's own)."""
        codec = self.node_ctx.codec
        # A rotated codec marks whole spans missing, so contributions are counted per span
        # (unit = span) and masked and divided span by span: no pass over a per-coordinate
        # mask. The sum starts with the local contribution, then ranks in order: the same
        # additions on every run. `count` exists once something is missing somewhere.
        unit = self.node_ctx.span if codec.rotated else 1
        total = local.to(torch.float32).clone() if local is not None else None
        whole = int(local is not None)
        count: torch.Tensor | None = None  # (units,) contributions per unit
        self.planes = np.full(self.got.shape, -1, dtype=np.int64)
        trimmed = 0
        for r in range(len(self.order)):
            came = self.got[r] >= 0
            if not came.any():
                continue
            # the slots are the layout's order: decoded as they are, no copy, no search
            t = torch.from_numpy
            packets = Packets(span=self.slot_span, index=self.slot_index, coords=self.slot_coords,
                              scale=t(self.scale[r]), body=t(self.body[r]), length=t(self.got[r]))
            dec = codec.decode_in_order(packets, self.ctx, self.numel)
            x = dec.tensor
            # nothing missing: every packet arrived with some bits of each of its coordinates
            # (a per-packet check instead of a pass over the whole mask)
            if bool((dec.stats["present"] == packets.coords).all()):
                whole += 1
            else:
                miss = dec.missing[::unit]  # one flag per unit
                if miss.any():
                    _zero_units(x, unit, miss)
                count = (~miss).float() if count is None else count.add_(~miss)
            total = x if total is None else total.add_(x)
            trimmed += int((came & (self.got[r] + wire.HEADER_LEN < self.sent[r])).sum())
            self.planes[r] = np.where(came, dec.stats["planes"].numpy(), -1)
        if total is None:
            total, least = torch.zeros(self.numel), 0
        elif count is None:
            least = whole
            if whole > 1:
                total.div_(whole)
        else:
            count.add_(whole)
            least = int(count.min())
            if int(count.max()) > 1:  # (dividing by one changes nothing)
                _divide_units(total, unit, count.clamp_(min=1))
        per_rank = {rank: int(self.received[i]) for i, rank in enumerate(self.order)}
        received = sum(per_rank.values())
        expected = self.expected * len(self.order)
        return Reduced(total, least, received, trimmed, expected, expected - received, per_rank)

    @staticmethod
    def _log_columns(a: Arrived, rows: np.ndarray | None, status: np.ndarray, key: np.ndarray) -> dict:
        """One batch's log: every datagram of the expected senders (another host's are not
        theirs). Only `a`'s own arrays are read (never its data: a receive buffer)."""
        f, n = a.head, len(status)
        pick = (lambda v: v) if rows is None else (lambda v: v[rows])  # noqa: E731
        length, sent = pick(a.length), pick(f["length"])
        cols = {"t_ns": np.full(n, a.time_ns, dtype=np.int64), "src": pick(a.peer), "dscp": pick(a.dscp),
                "step": pick(f["step"]), "rank": pick(f["rank"]), "bucket": pick(f["bucket"]),
                "span": pick(f["span"]), "packet": pick(f["packet"]), "coords": pick(f["coords"]),
                "sent_len": sent, "recv_len": length, "trimmed": (length < sent).astype(np.int64),
                "_slot": key, "status": rx.status_column(status)}
        known = status != rx.CODE["rank_mismatch"]
        return cols if known.all() else {k: v[known] for k, v in cols.items()}

    @property
    def rows(self) -> dict[str, np.ndarray]:
        """The packet log of this bucket (config.PACKET_LOG_FIELDS, as columns): every
        datagram it was given, with the planes decoded once it was reduced."""
        if not self._log:
            return {k: np.zeros(0, dtype=np.int64) for k in PACKET_LOG_FIELDS}
        parts = [self._log_columns(*entry) for entry in self._log]
        cols = {k: np.concatenate([b[k] for b in parts]) for k in parts[0]}
        slot = cols.pop("_slot")
        planes = getattr(self, "planes", None)
        cols["planes"] = np.where(slot >= 0, planes.reshape(-1)[np.maximum(slot, 0)], -1) \
            if planes is not None else np.full(len(slot), -1, dtype=np.int64)
        cols["src"] = np.asarray(self.node_ctx.peer_addrs, dtype=object)[cols["src"]]
        return {k: cols[k] for k in PACKET_LOG_FIELDS}
