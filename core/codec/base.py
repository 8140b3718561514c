"""What every codec shares: the span/packet layout, the packet batch, encode and decode.

A bucket (a flat float tensor of `numel` coordinates) is cut into spans of `span`
coordinates; the last, shorter span is zero-padded (to a power of two for rotated codecs,
to a multiple of 32 otherwise). Rotated codecs apply the RHT per span. Each span is sliced
into packets of `coords` (B) coordinates; the last packet of a span may carry fewer (still a
multiple of 32). A codec only has to say how one uniform block of packets, a (P, c)
matrix, becomes payload bodies and back (`encode_block` / `decode_block`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import numpy as np
import torch

from trimlab.codec import kernels, rht
from trimlab.errors import CodecError

MAX_PACKETS_PER_SPAN = 256  # the header's packet index is one byte
MAX_SPANS = 1 << 16  # the header's span index is two bytes


@dataclass(frozen=True)
class CodecContext:
    """Identity of one bucket's encoding: the RHT signs depend on all of it."""

    seed: int = 0
    step: int = 0
    bucket: int = 0
    span: int = 4096  # coordinates per span n (a power of two, ≥ 32)
    coords: int = 1024  # coordinates per packet B (a multiple of 32)


@dataclass
class Packets:
    """A batch of packets of one bucket. Row p is one packet; `body` is zero-padded to
    the longest packet and only its first `length[p]` bytes are meaningful (a trimmed
    packet has a smaller length than it was sent with)."""

    span: torch.Tensor  # (P,) int64: span index
    index: torch.Tensor  # (P,) int64: packet index in its span
    coords: torch.Tensor  # (P,) int64: coordinates this packet carries
    scale: torch.Tensor  # (P,) float32: per-packet scale (header)
    body: torch.Tensor  # (P, L) uint8
    length: torch.Tensor  # (P,) int64: body bytes present

    def __len__(self) -> int:
        return int(self.span.shape[0])

    def select(self, rows: torch.Tensor) -> "Packets":
        """The packets at `rows` (a bool mask or an index tensor)."""
        return Packets(*(getattr(self, f.name)[rows] for f in dataclasses.fields(self)))

    def truncated(self, nbytes: int | torch.Tensor) -> "Packets":
        """The same packets with bodies cut to at most `nbytes` bytes, as a trim would."""
        return dataclasses.replace(self, length=torch.clamp(self.length, max=nbytes))


class Decoded(NamedTuple):
    """`tensor, missing, stats = codec.decode(...)`."""

    tensor: torch.Tensor  # (numel,) float32; missing coordinates hold zero-filled estimates
    missing: torch.Tensor  # (numel,) bool, read-only (nothing missing: one False, expanded)
    stats: dict[str, torch.Tensor]  # per input packet, in input order: bytes, present, planes


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
        return _cat(span), _cat(index), _cat(coords), _cat(length)


class Codec:
    """A trimmable gradient encoding. Subclasses define the per-packet coder."""

    name: ClassVar[str]
    codec_id: ClassVar[int]
    rotated: bool = False
    # Scale each span by a power of two (its peak to [0.5, 1)) before rotating, and decode
    # scaled likewise: exact (the same bytes and values for buckets of ordinary size) and
    # no overflow or underflow in the rotation or the norm across float32's whole range.
    prescaled: bool = False
    planes: int = 0  # K, carried in the header
    unbiased: bool = False
    native: ClassVar[bool] = False  # kernels.c codes it (by its codec_id); False: torch only

    FLAG_UNBIASED: ClassVar[int] = 0x1
    FLAG_ROTATED: ClassVar[int] = 0x2

    @property
    def flags(self) -> int:
        return (self.FLAG_UNBIASED if self.unbiased else 0) | (self.FLAG_ROTATED if self.rotated else 0)

    def params(self) -> dict:
        """The parameters that rebuild this codec with get_codec(name, **params)."""
        return {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}({args})"

    # -- the per-packet coder -------------------------------------------------------------
    def body_bytes(self, coords: int) -> int:
        """Payload bytes (after the header) of an untrimmed packet of `coords` coordinates."""
        raise NotImplementedError

    def encode_block(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(P, c) float32 → bodies (P, body_bytes(c)) uint8 and scales (P,) float32."""
        raise NotImplementedError

    def decode_block(self, body: torch.Tensor, length: torch.Tensor,
                     scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bodies (P, body_bytes(c)) with bytes past `length` zeroed → estimates (P, c)
        and the number of leading coordinates that carry any information (P,)."""
        raise NotImplementedError

    def present_coords(self, coords: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
        """How many leading coordinates of a packet carry any information when `nbytes` of
        its body arrive."""
        raise NotImplementedError

    def expected_nmse(self, coords: torch.Tensor, nbytes: torch.Tensor) -> torch.Tensor:
        """Theoretical per-packet NMSE on Gaussian input when `nbytes` of the body arrive."""
        raise NotImplementedError

    def native_tables(self, device: str) -> dict[str, torch.Tensor]:
        """The lookup tables kernels.c reads (thresholds, poly, table), shared with the
        reference so that both quantize and reconstruct from the same numbers."""
        return {}

    def implementation(self, device: torch.device | str = "cpu") -> str:
        """'native' (kernels.c) or 'torch' (the reference): what codes on `device`."""
        return kernels.implementation(self, device)

    # -- whole buckets --------------------------------------------------------------------
    def layout(self, numel: int, ctx: CodecContext) -> Layout:
        return _layout(numel, ctx.span, ctx.coords, self.rotated)

    def skeleton(self, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`lay.skeleton(self.body_bytes)`, cached: span, index, coords and body bytes of each
        packet in the layout's order (read-only tensors)."""
        return _skeleton(lay, self.body_bytes(32))

    def _signs(self, ctx: CodecContext, g: SpanGroup, device) -> torch.Tensor:
        return rht.span_sign_masks(ctx.seed, ctx.step, ctx.bucket,
                                   range(g.first, g.first + g.count), g.size, device=device)

    def _blocks(self, x: torch.Tensor, ctx: CodecContext):
        """(block, y, span index, packet index, exponent) per block: y is the block's (P, c)
        matrix of (rotated) coordinates, one row per packet, span-major; each row's true
        values are y · 2^exponent (exponent 0 unless the codec is prescaled)."""
        flat = x.detach().reshape(-1).to(torch.float32)
        lay = self.layout(flat.numel(), ctx)
        device = flat.device
        spans, exps = {}, {}
        for g in lay.groups:
            chunk = flat[g.start:g.start + g.count * g.filled].reshape(g.count, g.filled)
            if g.filled < g.size:
                chunk = torch.nn.functional.pad(chunk, (0, g.size - g.filled))
            exps[g] = span_exponents(chunk.abs().amax(dim=1)) if self.prescaled \
                else torch.zeros(g.count, dtype=torch.int32, device=device)
            if self.prescaled:
                chunk = torch.ldexp(chunk, -exps[g][:, None])
            spans[g] = rht.rotate(chunk, self._signs(ctx, g, device)) if self.rotated else chunk
        for b in lay.blocks:
            y = lay.block_view(spans[b.group], b).reshape(-1, b.coords)
            span_idx = torch.arange(b.group.first, b.group.first + b.group.count, device=device)
            pkt_idx = torch.arange(b.first_index, b.first_index + b.per_span, device=device)
            yield (b, y, span_idx.repeat_interleave(b.per_span), pkt_idx.repeat(b.group.count),
                   exps[b.group].repeat_interleave(b.per_span))

    def body_shape(self, numel: int, ctx: CodecContext) -> tuple[int, int]:
        """(packets, bytes of the longest body) of `encode` for `numel` coordinates."""
        lay = self.layout(numel, ctx)
        return (sum(b.group.count * b.per_span for b in lay.blocks),
                max(self.body_bytes(b.coords) for b in lay.blocks))

    def encode(self, x: torch.Tensor, ctx: CodecContext, body: torch.Tensor | None = None) -> Packets:
        """Encode a flat float tensor into packets (span-major order within each block).
        `body`: where the bodies go, a CPU uint8 tensor of `body_shape` (its rows may be
        strided, e.g. the body columns of a frames array); the packets' body is then it."""
        if self.implementation(x.device) == "native":
            return self._encode_native(x, ctx, body)
        parts = []
        for b, y, span_idx, pkt_idx, exp in self._blocks(x, ctx):
            blk, scale = self.encode_block(y)
            parts.append((span_idx, pkt_idx, b.coords, torch.ldexp(scale, exp), blk))
        packets = _concat(parts, x.device)
        if body is not None:
            body.copy_(packets.body)
            packets.body = body
        return packets

    def _encode_native(self, x: torch.Tensor, ctx: CodecContext, body: torch.Tensor | None) -> Packets:
        flat = x.detach().reshape(-1).to(torch.float32).contiguous()
        lay = self.layout(flat.numel(), ctx)
        # the cached skeleton, copied (the caller owns what encode returns): building it
        # afresh was some 20 torch operations, 0.17 ms a 4 Mi bucket with the caches cold
        span, index, coords, length = (t.clone() for t in self.skeleton(lay))
        if body is None:
            body = torch.empty(length.shape[0], int(length.max()), dtype=torch.uint8)
        scale = torch.empty(length.shape[0], dtype=torch.float32)
        kernels.encode_groups(self, flat, ctx, lay, body, scale)
        return Packets(span, index, coords, scale, body, length)

    # -- untrimmed packets as one byte string (the reliable channel's compressed form) -------
    def packed_size(self, numel: int, ctx: CodecContext) -> int:
        """Bytes of `pack` for a tensor of `numel` coordinates: every scale, then every body."""
        lay = self.layout(numel, ctx)
        return sum(b.group.count * b.per_span * (4 + self.body_bytes(b.coords)) for b in lay.blocks)

    def pack(self, packets: Packets) -> bytes:
        """The untrimmed `packets` of one encode, as bytes: scales, then bodies in order."""
        body = packets.body.cpu()
        parts = [packets.scale.cpu().to(torch.float32).contiguous().numpy().tobytes()]
        width = packets.length.cpu()
        start = 0
        while start < len(packets):  # runs of equal length: one slice each
            n = int((width[start:] == width[start]).int().cumprod(0).sum())
            parts.append(body[start:start + n, :int(width[start])].contiguous().numpy().tobytes())
            start += n
        return b"".join(parts)

    def unpack(self, data: bytes, ctx: CodecContext, numel: int) -> Packets:
        """Inverse of `pack` for a tensor of `numel` coordinates (CPU tensors)."""
        lay = self.layout(numel, ctx)
        span, index, coords, length = lay.skeleton(self.body_bytes)
        if len(data) != self.packed_size(numel, ctx):
            raise CodecError(f"packed {self.name} data of {len(data)} bytes; {numel} coordinates "
                             f"need {self.packed_size(numel, ctx)}")
        raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        p = len(length)
        scale = raw[:4 * p].view(torch.float32)
        body = torch.zeros(p, int(length.max()), dtype=torch.uint8)
        row, at = 0, 4 * p
        for b in lay.blocks:
            n, w = b.group.count * b.per_span, self.body_bytes(b.coords)
            body[row:row + n, :w] = raw[at:at + n * w].view(n, w)
            row, at = row + n, at + n * w
        return Packets(span, index, coords, scale, body, length)

    def packet_errors(self, x: torch.Tensor, ctx: CodecContext, span: torch.Tensor,
                      index: torch.Tensor, nbytes: torch.Tensor) -> dict[str, torch.Tensor]:
        """The true error of packets (span, index) of bucket `x` when `nbytes` of each body
        arrive (< 0: the packet was lost). Measured where the codec quantizes (after the
        rotation, which is orthonormal, so a span's error is the sum of its packets'):
        `error` = ‖ŷ − y‖², `energy` = ‖y‖², and the `scale` the encoder wrote in the header
        (for checking a re-encoding against the wire). NaN for a (span, index) the layout
        does not have."""
        n = span.shape[0]
        out = {k: torch.full((n,), float("nan"), dtype=torch.float64) for k in ("error", "energy", "scale")}
        span, index, nbytes = span.cpu().long(), index.cpu().long(), nbytes.cpu().long()
        for b, y, _, _, exp in self._blocks(x, ctx):
            g = b.group
            rows = ((span >= g.first) & (span < g.first + g.count) & (index >= b.first_index)
                    & (index < b.first_index + b.per_span)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            pos = ((span[rows] - g.first) * b.per_span + index[rows] - b.first_index).to(y.device)
            yb = y.index_select(0, pos)
            body, scale = self.encode_block(yb)
            unit = torch.ldexp(torch.ones_like(scale, dtype=torch.float64), exp.index_select(0, pos))
            full = body.shape[1]
            got = nbytes[rows].to(y.device)
            keep = torch.arange(full, device=y.device)[None, :] < got.clamp(min=0)[:, None]
            yhat, _ = self.decode_block(body * keep, got.clamp(min=0, max=full), scale)
            yhat = torch.where((got >= 0)[:, None], yhat, torch.zeros_like(yhat))
            out["error"][rows] = (((yhat - yb).double() ** 2).sum(1) * unit ** 2).cpu()
            out["energy"][rows] = ((yb.double() ** 2).sum(1) * unit ** 2).cpu()
            out["scale"][rows] = torch.ldexp(scale, exp.index_select(0, pos)).double().cpu()
        return out

    def decode(self, packets: Packets, ctx: CodecContext, numel: int) -> Decoded:
        """Decode whatever arrived (any subset, any order, any prefix of each body).
        A coordinate is missing when no bit of it arrived; for rotated codecs the rotation
        spreads that over the span, so every coordinate of such a span is marked missing
        (its value is still the zero-filled estimate). Packets whose span, index or size
        the layout does not have are ignored."""
        use_native = self.implementation(packets.body.device) == "native"
        if use_native and self._in_layout_order(packets, self.layout(numel, ctx)):  # as encode wrote them
            return self.decode_in_order(packets, ctx, numel)
        return self._decode_any(packets, ctx, numel, use_native)

    def _decode_any(self, packets: Packets, ctx: CodecContext, numel: int, use_native: bool) -> Decoded:
        """decode() of packets in any order: each one's place looked up in the layout."""
        lay = self.layout(numel, ctx)
        device = packets.body.device
        nbytes = packets.length.clamp(min=0)
        coords = packets.coords.clamp(min=1)
        present = self.present_coords(coords, nbytes)
        values, missing = [], []
        for g in lay.groups:
            per_span = lay.packets_in_span(g)
            sizes = torch.full((per_span,), lay.coords, dtype=torch.int64, device=device)
            sizes[-1] = g.size - (per_span - 1) * lay.coords
            rows = ((packets.span >= g.first) & (packets.span < g.first + g.count)
                    & (packets.index >= 0) & (packets.index < per_span)).nonzero().squeeze(1)
            if len(rows) == len(packets):  # every packet is this group's (the usual case): no gathers
                fits = packets.coords == sizes[packets.index]
                rows = rows if bool(fits.all()) else rows[fits]
            else:
                rows = rows[packets.coords[rows] == sizes[packets.index[rows]]]
            every = len(rows) == len(packets)
            span = packets.span - g.first if every else packets.span[rows] - g.first
            pkt = packets.index if every else packets.index[rows]
            exp = self._decode_exponents(packets, g, every)
            if use_native:
                xs = self._decode_group_native(packets, ctx, lay, g, rows, span, pkt, nbytes, exp)
            else:
                xs = self._decode_group_torch(packets, ctx, lay, g, rows, span, pkt, nbytes, exp)
            got = torch.zeros(g.count, per_span, dtype=torch.int64, device=device)  # coords with info
            got[span, pkt] = present if every else present[rows]
            values.append(xs)
            missing.append(self._missing(lay, g, got, sizes))
        return Decoded(_cat(values), _cat(missing), self._stats(nbytes, coords, present))

    def _in_layout_order(self, packets: Packets, lay: Layout) -> bool:
        """Whether `packets` are the layout's, one each, in its order, none of them empty
        (length ≥ 0): then decode_in_order gives decode()'s result without the search."""
        span, index, coords, _ = self.skeleton(lay)
        if packets.span.device.type != "cpu" or len(packets) != len(span):
            return False
        # in numpy: a third less time than torch's, with the caches cold after a bucket's kernel
        span, index, coords = span.numpy(), index.numpy(), coords.numpy()
        return bool((packets.span.numpy() == span).all() and (packets.index.numpy() == index).all()
                    and (packets.coords.numpy() == coords).all() and (packets.length.numpy() >= 0).all())

    def _missing(self, lay: Layout, g: SpanGroup, got: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        """Group `g`'s missing mask, flat, from the coordinates known of each (span, packet)."""
        short = got < sizes
        if not short.any():
            return _nothing_missing(g, got.device)
        if self.rotated:  # each span's flag repeated (8× faster than flattening an expand)
            return short.any(dim=1).repeat_interleave(g.filled)
        # coordinate i of packet p is missing past what arrived of p
        col = torch.arange(lay.coords, device=got.device)
        return (col[None, None, :] >= got[:, :, None]).reshape(g.count, -1)[:, :g.filled].reshape(-1)

    def _stats(self, nbytes: torch.Tensor, coords: torch.Tensor, present: torch.Tensor) -> dict:
        if nbytes.device.type == "cpu":  # (numpy: a third of torch's time on a bucket's packets)
            planes = torch.from_numpy(np.minimum(8 * nbytes.numpy() // coords.numpy(), self.planes))
        else:
            planes = torch.clamp((8 * nbytes) // coords, max=self.planes)
        return {"bytes": nbytes, "present": present, "planes": planes}

    def decode_in_order(self, packets: Packets, ctx: CodecContext, numel: int) -> Decoded:
        """decode() of a bucket's packets given in the layout's order (Layout.skeleton's:
        row i is its i-th packet, span, index and coords as the skeleton has them), with
        length < 0 where a packet never came, as a collector holds them. The same tensor
        and mask as decode() of the rows that came, and its stats per row (0 for a row that
        never came). With the native kernels the bookkeeping is a few numpy operations on
        the layout's cached row map (decode() spends some 40 small torch operations finding
        each packet's place: half a millisecond a bucket, as long as the kernel itself)."""
        length = packets.length
        if self.implementation(packets.body.device) != "native":  # the reference
            came = (length >= 0).nonzero().squeeze(1)
            dec = self._decode_any(packets.select(came), ctx, numel, False)
            stats = {k: torch.zeros(len(packets), dtype=v.dtype).index_copy_(0, came, v)
                     for k, v in dec.stats.items()}
            return Decoded(dec.tensor, dec.missing, stats)
        lay = self.layout(numel, ctx)
        ln = length.numpy()
        coords = packets.coords  # the skeleton's (≥ 32 each)
        # every packet came whole (the usual case): nothing is missing, nothing to mask
        whole = bool((ln == self.skeleton(lay)[3].numpy()).all())
        came = None if whole else ln >= 0
        nbytes = length.clamp(min=0)
        # (stats are the caller's: never the skeleton's cached tensors themselves)
        present = coords.clone() if whole else self.present_coords(coords, nbytes).masked_fill_(length < 0, 0)
        # the header scales as they came: the kernel derives a prescaled span's exponent
        # from those of its packets that came (the rule of _decode_exponents)
        scale = packets.scale.to(torch.float32).contiguous()
        body = packets.body.contiguous()
        width = nbytes.clamp(max=body.shape[1]).contiguous()
        values, missing = [], []
        for g, rows, rows_t, sizes in _row_order(lay):
            slots = rows_t.reshape(-1) if whole else torch.from_numpy(np.where(came[rows], rows, -1).reshape(-1))
            out = torch.empty(g.count * g.filled, dtype=torch.float32)
            kernels.decode_group(self, ctx, g, body, slots, width, scale, None, out)
            values.append(out)
            missing.append(_nothing_missing(g, body.device) if whole else self._missing(lay, g, present[rows_t], sizes))
        # whole packets: the planes of each are the layout's, computed once
        stats = ({"bytes": nbytes, "present": present,
                  "planes": _whole_planes(lay, self.body_bytes(32), self.planes).clone()} if whole
                 else self._stats(nbytes, coords, present))
        return Decoded(_cat(values), _cat(missing), stats)

    def _decode_group_torch(self, packets, ctx, lay, g, rows, span, pkt, nbytes, exp) -> torch.Tensor:
        """The reference: the group's filled coordinates, flat."""
        device = packets.body.device
        ybuf = torch.zeros(g.count, g.size, dtype=torch.float32, device=device)
        for b in (b for b in lay.blocks if b.group is g):
            sel = ((pkt >= b.first_index) & (pkt < b.first_index + b.per_span)).nonzero().squeeze(1)
            if sel.numel() == 0:
                continue
            body, length = _block_body(packets, rows[sel], nbytes, self.body_bytes(b.coords))
            yhat, _ = self.decode_block(body, length, torch.ldexp(packets.scale[rows[sel]], -exp[span[sel]]))
            lay.block_view(ybuf, b)[span[sel], pkt[sel] - b.first_index] = yhat
        xs = ybuf
        if self.rotated:
            xs = rht.unrotate(ybuf, self._signs(ctx, g, device))
        if self.prescaled:
            xs = torch.ldexp(xs, exp[:, None])
        return xs[:, :g.filled].reshape(-1)

    def _decode_group_native(self, packets, ctx, lay, g, rows, span, pkt, nbytes, exp) -> torch.Tensor:
        per_span = lay.packets_in_span(g)
        body = packets.body.contiguous()
        slots = torch.full((g.count * per_span,), -1, dtype=torch.int64)
        slots[span * per_span + pkt] = rows
        row_scale = packets.scale.to(torch.float32).contiguous()
        if self.prescaled and len(rows) == len(row_scale):  # (others' exponents are 0)
            row_scale = torch.ldexp(row_scale, -exp[span])
        elif self.prescaled:
            row_scale = row_scale.clone()
            row_scale[rows] = torch.ldexp(row_scale[rows], -exp[span])
        out = torch.empty(g.count * g.filled, dtype=torch.float32)
        kernels.decode_group(self, ctx, g, body, slots, nbytes.clamp(max=body.shape[1]).contiguous(),
                            row_scale, exp.to(torch.int32).contiguous(), out)
        return out

    def _decode_exponents(self, packets: Packets, g: SpanGroup, every: bool = False) -> torch.Tensor:
        """Per span of `g`: the power of two its packets' scales are divided by while
        decoding (from the largest scale that arrived), so unrotating cannot overflow.
        `every`: all the packets are the group's (no selection)."""
        if not self.prescaled:
            return torch.zeros(g.count, dtype=torch.int32, device=packets.body.device)
        span, scale = packets.span, packets.scale
        if not every:
            sel = ((span >= g.first) & (span < g.first + g.count)).nonzero().squeeze(1)
            span, scale = span[sel], scale[sel]
        peak = torch.zeros(g.count, dtype=torch.float32, device=packets.body.device)
        peak = peak.scatter_reduce(0, span - g.first, scale.abs(), "amax")
        return span_exponents(peak)


def lane_sum(v: torch.Tensor) -> torch.Tensor:
    """Row sums of v (P, c), c a multiple of 32, in the order kernels.c uses: 32 lanes
    accumulated row after row of 32, then folded in halves (16, 8, 4, 2, 1)."""
    lanes = v.reshape(v.shape[0], -1, 32)
    acc = torch.zeros_like(lanes[:, 0])
    for r in range(lanes.shape[1]):
        acc = acc + lanes[:, r]
    w = 16
    while w:
        acc = acc[:, :w] + acc[:, w:2 * w]
        w //= 2
    return acc[:, 0]


def div_rn(a: torch.Tensor, n: int) -> torch.Tensor:
    """a / n correctly rounded, as kernels.c divides, on any device: torch's CUDA kernel
    turns a division by a Python number into a product with its reciprocal, one ulp off
    at times (a CUDA encode's scales then differed from the CPU's), so n goes as a tensor."""
    return a / torch.full_like(a, n)


def sqrt_rn(q: torch.Tensor) -> torch.Tensor:
    """√q correctly rounded in float32, as IEEE sqrtf (kernels.c) gives it, on any device:
    torch's CPU sqrt can be one ulp off. From torch's estimate, step to the neighbour when
    q lies beyond the midpoint's square (exact in float64: 25-bit midpoints)."""
    r = torch.sqrt(q)
    lo = torch.nextafter(r, torch.zeros_like(r))
    hi = torch.nextafter(r, torch.full_like(r, math.inf))
    q64, r64 = q.double(), r.double()
    down = (lo.double() + r64) / 2
    up = (r64 + hi.double()) / 2
    return torch.where(q64 < down * down, lo, torch.where(q64 > up * up, hi, r))


def span_exponents(peak: torch.Tensor) -> torch.Tensor:
    """e with peak = m·2^e, m in [0.5, 1), clamped so that 2^±e is a normal float32; 0 for
    a zero or non-finite peak (NaN and Inf then stay non-finite through the codec); as
    kernels.c's exponent_of_top."""
    _, e = torch.frexp(peak)
    ok = torch.isfinite(peak) & (peak > 0)
    return torch.where(ok, e.clamp(-126, 126), torch.zeros_like(e)).to(torch.int32)


@functools.lru_cache(maxsize=64)
def _layout(numel: int, span: int, coords: int, rotated: bool) -> Layout:
    """Layouts are pure functions of their arguments and never changed: one per shape."""
    return Layout(numel, span, coords, pow2_tail=rotated)


@functools.lru_cache(maxsize=64)
def _row_order(lay: Layout) -> list[tuple[SpanGroup, np.ndarray, torch.Tensor, torch.Tensor]]:
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
def _skeleton(lay: Layout, per32: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layout.skeleton for a codec whose bodies take per32 bytes a 32 coordinates (every
    codec's), once per layout; the tensors are only read."""
    return lay.skeleton(lambda c: per32 * c // 32)


def _nothing_missing(g: SpanGroup, device) -> torch.Tensor:
    """A group's mask when nothing is missing (the usual case): one False seen everywhere."""
    return _falses(g.count * g.filled, str(device))


@functools.lru_cache(maxsize=64)
def _whole_planes(lay: Layout, per32: int, planes: int) -> torch.Tensor:
    """Codec._stats' planes of every packet of the layout, each come whole (only read)."""
    _, _, coords, length = _skeleton(lay, per32)
    return torch.clamp(8 * length // coords, max=planes)


@functools.lru_cache(maxsize=64)
def _falses(n: int, device: str) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=device).expand(n)  # (read-only: expanded)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _block_body(packets: Packets, rows: torch.Tensor, nbytes: torch.Tensor,
                full: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The bodies of `rows`, exactly `full` bytes wide, zero past each packet's length.
    Rows in order are a view (no copy); only trimmed rows are masked."""
    n = rows.numel()
    r0 = int(rows[0])
    if int(rows[-1]) - r0 == n - 1:  # rows are sorted and unique, so this is a range
        body = packets.body[r0:r0 + n]
    else:
        body = packets.body[rows]
    body = _pad_cols(body, full)
    length = nbytes[rows].clamp(max=full)
    cut = (length < full).nonzero().squeeze(1)
    if cut.numel():
        keep = torch.arange(full, device=body.device)[None, :] < length[cut, None]
        body = body.clone()
        body[cut] = body[cut] * keep
    return body, length


def _pad_cols(body: torch.Tensor, width: int) -> torch.Tensor:
    if body.shape[1] >= width:
        return body[:, :width]
    return torch.nn.functional.pad(body, (0, width - body.shape[1]))


def _concat(parts, device) -> Packets:
    width = max(body.shape[1] for *_, body in parts)
    p = sum(body.shape[0] for *_, body in parts)
    body_all = torch.zeros(p, width, dtype=torch.uint8, device=device)
    row = 0
    for *_, body in parts:
        body_all[row:row + body.shape[0], :body.shape[1]] = body
        row += body.shape[0]
    return Packets(
        span=torch.cat([s for s, *_ in parts]),
        index=torch.cat([i for _, i, *_ in parts]),
        coords=torch.cat([torch.full((body.shape[0],), c, dtype=torch.int64, device=device)
                          for _, _, c, _, body in parts]),
        scale=torch.cat([sc for *_, sc, _ in parts]).to(torch.float32),
        body=body_all,
        length=torch.cat([torch.full((body.shape[0],), body.shape[1], dtype=torch.int64,
                                     device=device) for *_, body in parts]),
    )
