"""Where every coordinate of a bucket goes: spans, packets, and blocks of equal packets.

A bucket (a flat float tensor of `numel` coordinates) is cut into spans of `span`
coordinates; the last, shorter span is zero-padded (to a power of two for rotated codecs,
to a multiple of 32 otherwise). Each span is sliced into packets of `coords` (B)
coordinates; the last packet of a span may carry fewer (still a multiple of 32). Layouts
are pure functions of their shape, cached, and never changed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from trimlab.errors import CodecError

MAX_PACKETS_PER_SPAN = 256  # the header's packet index is one byte
MAX_SPANS = 1 << 16  # the header's span index is two bytes


@dataclass(frozen=True)
class SpanGroup:
    """Spans of equal (padded) size: the full spans, or the one shorter last span."""

    first: int  # index of the first span
    count: int  # number of spans
    size: int  # coordinates per span, padding included
    start: int  # offset of the first span in the flat tensor
    filled: int  # real (unpadded) coordinates per span


@dataclass(frozen=True)
class Block:
    """Packets of equal size within one span group."""

    group: SpanGroup
    first_index: int  # packet index (in span) of the block's first packet
    per_span: int  # packets per span in this block
    coords: int  # coordinates per packet


def _next_pow2(v: int) -> int:
    return 1 << max(0, (v - 1).bit_length())


class Layout:
    """Where every coordinate of a bucket goes: spans, packets, blocks of equal packets."""

    def __init__(self, numel: int, span: int, coords: int, pow2_tail: bool):
        if numel < 1:
            raise CodecError(f"bucket has {numel} coordinates; it needs at least 1")
        if span < 32 or span & (span - 1):
            raise CodecError(f"span={span}: must be a power of two ≥ 32")
        if coords < 32 or coords % 32:
            raise CodecError(f"coords={coords}: B must be a positive multiple of 32")
        if math.ceil(span / coords) > MAX_PACKETS_PER_SPAN:
            raise CodecError(f"span={span} with coords={coords} needs more than "
                             f"{MAX_PACKETS_PER_SPAN} packets per span; raise coords or lower span")
        full, rest = divmod(numel, span)
        if full + (rest > 0) > MAX_SPANS:
            raise CodecError(f"bucket of {numel} coordinates needs more than {MAX_SPANS} spans "
                             f"of {span}; split the bucket or raise span")
        self.numel, self.span, self.coords = numel, span, coords
        self.groups: list[SpanGroup] = []
        if full:
            self.groups.append(SpanGroup(0, full, span, 0, span))
        if rest:
            size = max(32, _next_pow2(rest)) if pow2_tail else -(-rest // 32) * 32
            self.groups.append(SpanGroup(full, 1, min(size, span), full * span, rest))
        self.blocks: list[Block] = []
        for g in self.groups:
            n_full, tail = divmod(g.size, coords)
            if n_full:
                self.blocks.append(Block(g, 0, n_full, coords))
            if tail:
                self.blocks.append(Block(g, n_full, 1, tail))

    def block_view(self, spans: torch.Tensor, b: Block) -> torch.Tensor:
        """The (spans, packets, coordinates) view of block `b` inside its group's
        (count, size) span matrix: a packet is one row of it."""
        start = b.first_index * self.coords
        return spans[:, start:start + b.per_span * b.coords].view(b.group.count, b.per_span, b.coords)

    def packets_in_span(self, group: SpanGroup) -> int:
        return -(-group.size // self.coords)

    def skeleton(self, body_bytes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Span, packet index, coordinates and body length of every packet, in the order
        encode writes them (block after block, span-major); `body_bytes(c)` sizes a body."""
        span, index, coords, length = [], [], [], []
        for b in self.blocks:
            g, n = b.group, b.group.count * b.per_span
            span.append(torch.arange(g.first, g.first + g.count).repeat_interleave(b.per_span))
            index.append(torch.arange(b.first_index, b.first_index + b.per_span).repeat(g.count))
            coords.append(torch.full((n,), b.coords, dtype=torch.int64))
            length.append(torch.full((n,), body_bytes(b.coords), dtype=torch.int64))
        return cat(span), cat(index), cat(coords), cat(length)


@functools.lru_cache(maxsize=64)
def layout_of(numel: int, span: int, coords: int, rotated: bool) -> Layout:
    """Layouts are pure functions of their arguments and never changed: one per shape."""
    return Layout(numel, span, coords, pow2_tail=rotated)


@functools.lru_cache(maxsize=64)
def row_order(lay: Layout) -> list[tuple[SpanGroup, np.ndarray, torch.Tensor, torch.Tensor]]:
    """Per group: the skeleton row of each (span, packet in span), (count, packets per
    span), as an array and as a tensor, and each packet index's coordinates."""
    out, first = [], 0
    per_group: dict[SpanGroup, list] = {}
    for b in lay.blocks:
        n = b.group.count * b.per_span
        rows = np.arange(first, first + n, dtype=np.int64).reshape(b.group.count, b.per_span)
        per_group.setdefault(b.group, []).append((rows, b))
        first += n
    for g, parts in per_group.items():
        rows = np.concatenate([r for r, _ in parts], axis=1)
        sizes = torch.tensor([b.coords for _, b in parts for _ in range(b.per_span)], dtype=torch.int64)
        out.append((g, rows, torch.from_numpy(rows), sizes))  # (the caller only reads them)
    return out


@functools.lru_cache(maxsize=64)
def skeleton_of(lay: Layout, per32: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layout.skeleton for a codec whose bodies take per32 bytes a 32 coordinates (every
    codec's), once per layout; the tensors are only read."""
    return lay.skeleton(lambda c: per32 * c // 32)


@functools.lru_cache(maxsize=64)
def whole_planes(lay: Layout, per32: int, planes: int) -> torch.Tensor:
    """Codec._stats' planes of every packet of the layout, each come whole (only read)."""
    _, _, coords, length = skeleton_of(lay, per32)
    return torch.clamp(8 * length // coords, max=planes)


def cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)
