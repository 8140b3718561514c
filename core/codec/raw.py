"""fp32 and bf16: raw contiguous values, no rotation (the naive baseline). A trim loses
every coordinate past the cut. Values go little-endian, as every host we target stores
them, so encoding is a view and decoding a copy (see core/codec/bits.py)."""

from __future__ import annotations

import torch

from trimlab.codec.base import Codec

# NMSE of rounding to bfloat16 (8 significant bits, round to nearest): ulp²/12 relative
# to x² averaged over the significand, ≈ 2^-14 / (12 · 7/3).
BF16_ROUNDING_NMSE = 2.0 ** -14 / 28


class _Raw(Codec):
    dtype: torch.dtype
    width: int  # bytes per coordinate
    rounding_nmse: float = 0.0

    def body_bytes(self, coords: int) -> int:
        return self.width * coords

    def encode_block(self, y):
        p, c = y.shape
        body = y.to(self.dtype).contiguous().view(torch.uint8).reshape(p, c * self.width)
        return body, torch.ones(p, dtype=torch.float32, device=y.device)

    def decode_block(self, body, length, scale):
        p = body.shape[0]
        c = body.shape[1] // self.width
        values = body.contiguous().view(self.dtype).reshape(p, c).to(torch.float32)
        present = self.present_coords(torch.full_like(length, c), length)
        # a value cut inside its bytes is missing too: 0, like those past the cut
        values = torch.where(torch.arange(c, device=body.device)[None, :] < present[:, None], values,
                             torch.zeros_like(values))
        return values, present

    def present_coords(self, coords, nbytes):
        return torch.clamp(nbytes // self.width, max=coords)

    def expected_nmse(self, coords, nbytes):
        present = torch.clamp(nbytes // self.width, max=coords)
        return (present * self.rounding_nmse + (coords - present)) / coords


class FP32(_Raw):
    name = "fp32"
    codec_id = 1
    dtype = torch.float32
    width = 4
    planes = 32
    native = True


class BF16(_Raw):
    name = "bf16"
    codec_id = 2
    dtype = torch.bfloat16
    width = 2
    planes = 16
    native = True
    rounding_nmse = BF16_ROUNDING_NMSE
