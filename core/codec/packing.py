"""Untrimmed packets of one encode as one byte string: the reliable channel's compressed
form (the all-gather's shards), every scale then every body, in layout order."""

from __future__ import annotations

import torch

from trimlab.codec.base import Codec, CodecContext, Packets
from trimlab.errors import CodecError


def packed_size(codec: Codec, numel: int, ctx: CodecContext) -> int:
    """Bytes of `pack` for a tensor of `numel` coordinates: every scale, then every body."""
    lay = codec.layout(numel, ctx)
    return sum(b.group.count * b.per_span * (4 + codec.body_bytes(b.coords)) for b in lay.blocks)

def pack(packets: Packets) -> bytes:
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

def unpack(codec: Codec, data: bytes, ctx: CodecContext, numel: int) -> Packets:
    """Inverse of `pack` for a tensor of `numel` coordinates (CPU tensors)."""
    lay = codec.layout(numel, ctx)
    span, index, coords, length = lay.skeleton(codec.body_bytes)
    if len(data) != packed_size(codec, numel, ctx):
        raise CodecError(f"packed {codec.name} data of {len(data)} bytes; {numel} coordinates "
                         f"need {packed_size(codec, numel, ctx)}")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    p = len(length)
    scale = raw[:4 * p].view(torch.float32)
    body = torch.zeros(p, int(length.max()), dtype=torch.uint8)
    row, at = 0, 4 * p
    for b in lay.blocks:
        n, w = b.group.count * b.per_span, codec.body_bytes(b.coords)
        body[row:row + n, :w] = raw[at:at + n * w].view(n, w)
        row, at = row + n, at + n * w
    return Packets(span, index, coords, scale, body, length)
