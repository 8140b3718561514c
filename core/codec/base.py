"""The per-packet interface every codec shares: encode a bucket into packets and decode
any subset of them, by the bucket's layout (`trimlab.codec.layout`), in torch or with the
native kernels (`trimlab.codec.kernels`). A codec only has to say how one uniform block of
packets, a (P, c) matrix, becomes payload bodies and back (`encode_block` /
`decode_block`); rotated codecs apply the RHT per span first. Packing for the all-gather
and error measurement are modules of their own (`packing`, `measure`).
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
from trimlab.codec.layout import Layout, SpanGroup, cat, layout_of, row_order, skeleton_of, whole_planes
from trimlab.errors import CodecError



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
        return layout_of(numel, ctx.span, ctx.coords, self.rotated)

    def skeleton(self, lay: Layout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`lay.skeleton(self.body_bytes)`, cached: span, index, coords and body bytes of each
        packet in the layout's order (read-only tensors)."""
        return skeleton_of(lay, self.body_bytes(32))

    def _signs(self, ctx: CodecContext, g: SpanGroup, device) -> torch.Tensor:
        return rht.span_sign_masks(ctx.seed, ctx.step, ctx.bucket,
                                   range(g.first, g.first + g.count), g.size, device=device)

    def blocks(self, x: torch.Tensor, ctx: CodecContext):
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
        for b, y, span_idx, pkt_idx, exp in self.blocks(x, ctx):
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
        return Decoded(cat(values), cat(missing), self._stats(nbytes, coords, present))

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
        for g, rows, rows_t, sizes in row_order(lay):
            slots = rows_t.reshape(-1) if whole else torch.from_numpy(np.where(came[rows], rows, -1).reshape(-1))
            out = torch.empty(g.count * g.filled, dtype=torch.float32)
            kernels.decode_group(self, ctx, g, body, slots, width, scale, None, out)
            values.append(out)
            missing.append(_nothing_missing(g, body.device) if whole else self._missing(lay, g, present[rows_t], sizes))
        # whole packets: the planes of each are the layout's, computed once
        stats = ({"bytes": nbytes, "present": present,
                  "planes": whole_planes(lay, self.body_bytes(32), self.planes).clone()} if whole
                 else self._stats(nbytes, coords, present))
        return Decoded(cat(values), cat(missing), stats)

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


def _nothing_missing(g: SpanGroup, device) -> torch.Tensor:
    """A group's mask when nothing is missing (the usual case): one False seen everywhere."""
    return _falses(g.count * g.filled, str(device))


@functools.lru_cache(maxsize=64)
def _falses(n: int, device: str) -> torch.Tensor:
    return torch.zeros((), dtype=torch.bool, device=device).expand(n)  # (read-only: expanded)


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
