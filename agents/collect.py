"""Gradient collection (the gradient port, trimmable DSCP): a `Collector` gathers one
(step, bucket) from the expected ranks until every packet arrived or the deadline passed,
then decodes each rank's packets at whatever precision arrived and averages per coordinate
over the contributions that arrived."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from trimlab import wire
from trimlab.agents.transport import Datagram
from trimlab.codec import CodecContext

if TYPE_CHECKING:  # types only: the node imports this module
    from trimlab.agents.node import Node


@dataclass
class Reduced:
    mean: torch.Tensor  # averaged gradient, 0 where no contribution arrived
    contributors: torch.Tensor  # (numel,) int: contributions averaged per coordinate
    packets: int
    trimmed: int
    expected: int
    missing: int  # packets never received (lost or after the deadline)
    per_rank: dict[int, int]  # rank -> packets received


class Collector:
    """Gradient packets of one (step, bucket) from the expected ranks."""

    def __init__(self, node: "Node", step: int, bucket: int, ranks: dict[int, str], numel: int,
                 deadline_s: float):
        self.node, self.step, self.bucket, self.ranks, self.numel = node, step, bucket, ranks, numel
        self.ctx = dict(span=node.span, coords=node.coords, seed=node.seed)
        lay = node.codec.layout(numel, CodecContext(seed=node.seed, step=step, bucket=bucket, span=node.span,
                                                    coords=node.coords))
        self.expected = sum(b.group.count * b.per_span for b in lay.blocks)
        self.deadline_s = deadline_s
        self.payloads: dict[int, list[bytes]] = {r: [] for r in ranks}
        self.seen: dict[int, set] = {r: set() for r in ranks}
        self.rows: list[list] = []
        self.opened = time.monotonic()
        self.first: float | None = None

    def add(self, d: Datagram, head: wire.Header) -> None:
        status = "accepted"
        key = (head.span, head.packet)
        if key in self.seen[head.rank]:
            status = "duplicate"
        elif len(self.seen[head.rank]) >= self.expected:
            status = "over_budget"
        else:
            self.seen[head.rank].add(key)
            self.payloads[head.rank].append(d.payload)
            self.first = self.first or time.monotonic()
        if status != "accepted":
            self.node.discarded[status] += 1
        self.rows.append([d.time_ns, d.src[0], d.dscp, head.step, head.rank, head.bucket, head.span,
                          head.packet, head.coords, head.length, len(d.payload),
                          int(len(d.payload) < head.length), -1, status])

    @property
    def complete(self) -> bool:
        return all(len(s) >= self.expected for s in self.seen.values())

    def expired(self, now: float) -> bool:
        return self.first is not None and now - self.first > self.deadline_s

    def reduce(self, local: torch.Tensor | None = None) -> Reduced:
        """Decode every rank's packets, average per coordinate over what arrived; `local` is
        an exact contribution that never crossed the network (a shard owner's own)."""
        node = self.node
        total = torch.zeros(self.numel)
        count = torch.zeros(self.numel, dtype=torch.int64)
        if local is not None:
            total += local
            count += 1
        planes: dict[tuple, int] = {}
        trimmed = 0
        for rank, payloads in self.payloads.items():
            if not payloads:
                continue
            dp = wire.depacketize(payloads, node.codec, self.numel,
                                  wire.PacketIds(node.job, self.step, rank, self.bucket), **self.ctx)
            ok = ~dp.decoded.missing
            total[ok] += dp.decoded.tensor[ok]
            count += ok
            trimmed += int(dp.trimmed.sum())
            for s, i, p in zip(dp.packets.span.tolist(), dp.packets.index.tolist(),
                               dp.decoded.stats["planes"].tolist()):
                planes[(rank, s, i)] = p
            for reason, n in dp.discarded.items():
                node.discarded[reason] += n
        for row in self.rows:
            if row[-1] == "accepted":
                row[12] = planes.get((row[4], row[6], row[7]), -1)
        per_rank = {r: len(s) for r, s in self.seen.items()}
        received = sum(per_rank.values())
        return Reduced(total / count.clamp(min=1), count, received, trimmed,
                       self.expected * len(self.ranks), self.expected * len(self.ranks) - received,
                       per_rank)
