"""The sign_tail codec (the paper's layout): a head of one sign bit per rotated coordinate,
then a tail with the other 31 bits of each float32, coordinate after coordinate.

Untrimmed, it decodes exactly; trimmed to the head, it is DRIVE's 1-bit estimate with the
header scale (biased ‖y‖₁/c, or unbiased ‖y‖²/‖y‖₁); a trim inside the tail keeps a
prefix of coordinates exact.
"""

from __future__ import annotations

import math

import torch

from trimlab.codec import bits
from trimlab.codec.base import Codec, div_rn, lane_sum


class SignTail(Codec):
    name = "sign_tail"
    codec_id = 3
    planes = 32
    native = True

    def __init__(self, unbiased: bool = False, rotate: bool = True):
        self.unbiased = bool(unbiased)
        self.rotated = bool(rotate)
        self._d1 = (math.pi / 2 - 1) if self.unbiased else (1 - 2 / math.pi)

    def params(self) -> dict:
        return {"unbiased": self.unbiased, "rotate": self.rotated}

    def body_bytes(self, coords: int) -> int:
        return 4 * coords

    def encode_block(self, y):
        p, c = y.shape
        raw = y.contiguous().view(torch.int32)
        sign = (raw >> 31) & 1
        head = bits.pack_planes(sign, 1).reshape(p, c // 8)
        tail = bits.words_to_bytes(bits.pack31(raw & 0x7FFFFFFF))
        # in float64: squares and sums of float32 values neither underflow nor overflow;
        # summed in kernels.c's order, so both implementations write the same scale
        y64 = y.double()
        l1 = lane_sum(y64.abs())
        if self.unbiased:
            scale = torch.where(l1 > 0, lane_sum(y64 * y64) / l1, torch.zeros_like(l1))
        else:
            scale = div_rn(l1, c)
        return torch.cat([head, tail], dim=1), scale.to(torch.float32)

    def decode_block(self, body, length, scale):
        p = body.shape[0]
        c = body.shape[1] // 4
        head_bytes = c // 8
        sign = bits.unpack_planes(body[:, :head_bytes].reshape(p, 1, head_bytes), 1)
        magnitude = bits.unpack31(bits.bytes_to_words(body[:, head_bytes:]))
        exact_val = (magnitude | (sign << 31)).view(torch.float32)
        words = torch.clamp(length - head_bytes, min=0) // 4
        exact = (words // 31) * 32 + words % 31
        have_sign = torch.clamp(8 * length, max=c)
        coord = torch.arange(c, device=body.device)[None, :]
        one_bit = (1 - 2 * sign).to(torch.float32) * scale[:, None]
        yhat = torch.where(coord < exact[:, None], exact_val,
                           torch.where(coord < have_sign[:, None], one_bit, torch.zeros_like(one_bit)))
        return yhat, have_sign

    def present_coords(self, coords, nbytes):
        return torch.clamp(8 * nbytes, max=coords)

    def expected_nmse(self, coords, nbytes):
        head = coords // 8
        have_sign = torch.clamp(8 * nbytes, max=coords)
        words = torch.clamp(nbytes - head, min=0) // 4
        exact = torch.clamp((words // 31) * 32 + words % 31, max=coords)
        return ((have_sign - exact) * self._d1 + (coords - have_sign)) / coords
