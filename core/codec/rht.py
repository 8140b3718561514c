"""Randomized Hadamard transform R(x) = H·D·x/√n over spans of n = 2^m coordinates.

The ±1 diagonal D comes from a counter-based hash of (seed, step, bucket, span,
coordinate), computed with integer arithmetic that never overflows int64, so the signs are
bit-identical on every host, OS, torch version and device (no torch.Generator).
H is applied as butterflies in a fixed stage order, which defines the float32 rounding
that the native kernel (kernels.c) reproduces bit for bit.
"""

from __future__ import annotations

import functools
import math

import torch

MASK32 = 0xFFFFFFFF
MASK64 = 0xFFFFFFFFFFFFFFFF


def _splitmix64(h: int) -> int:
    h = (h + 0x9E3779B97F4A7C15) & MASK64
    h = ((h ^ (h >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    h = ((h ^ (h >> 27)) * 0x94D049BB133111EB) & MASK64
    return h ^ (h >> 31)


def span_key(seed: int, step: int, bucket: int, span: int) -> int:
    """64-bit key of one span: exact Python integers, identical everywhere."""
    h = 0
    for word in (seed, step, bucket, span):
        h = _splitmix64(h ^ (word & MASK64))
    return h


def _mul32(a: torch.Tensor, c: int) -> torch.Tensor:
    """(a * c) mod 2^32 for int64 tensors holding uint32 values, split so nothing overflows."""
    lo = a & 0xFFFF
    hi = a >> 16
    return (lo * c + (((hi * c) & 0xFFFF) << 16)) & MASK32


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


_SHIFT = torch.arange(31, -1, -1, dtype=torch.int32)  # bit i of a hash word → bit 31
INT32_MIN = -(1 << 31)


def sign_masks(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Sign masks for spans with 64-bit `keys` (an int64 tensor (S,) holding the keys as
    signed values), n coordinates each (a multiple of 32): int32 (S, n), INT32_MIN where
    the coordinate is negated, else 0 — ready to XOR into float32 bits. Coordinate i takes
    bit i mod 32 of hash word i div 32."""
    k1 = keys & MASK32
    k2 = (keys >> 32) & MASK32
    words = torch.arange(n // 32, dtype=torch.int64, device=keys.device)
    h = _fmix32(_mul32(words[None, :], 0x9E3779B1) ^ k1[:, None])
    h = _fmix32(h ^ k2[:, None]).to(torch.int32)  # keeps the low 32 bits
    return ((h[:, :, None] << _SHIFT.to(keys.device)) & INT32_MIN).reshape(keys.shape[0], n)


def _signed64(key: int) -> int:
    return key - (1 << 64) if key >= 1 << 63 else key


def span_sign_masks(seed: int, step: int, bucket: int, spans: range, n: int,
                    device: torch.device | str = "cpu") -> torch.Tensor:
    """The sign masks of each span in `spans`: (len(spans), n) int32."""
    keys = torch.tensor([_signed64(span_key(seed, step, bucket, s)) for s in spans],
                        dtype=torch.int64, device=device)
    return sign_masks(keys, n)


def span_signs(seed: int, step: int, bucket: int, spans: range, n: int,
               device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ±1 diagonal D of each span in `spans`: (len(spans), n)."""
    negate = span_sign_masks(seed, step, bucket, spans, n, device) != 0
    return 1 - 2 * negate.to(dtype)


def flip_signs(x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """D·x: for float32 an XOR of the sign bits (one pass), else a multiply."""
    if x.dtype == torch.float32:
        return (x.contiguous().view(torch.int32) ^ masks).view(torch.float32)
    return x * (1 - 2 * (masks != 0).to(x.dtype))


@functools.lru_cache(maxsize=64)
def hadamard(n: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Sylvester Hadamard matrix H_n (entries ±1), H[i, j] = (-1)^popcount(i & j)."""
    idx = torch.arange(n)
    parity = torch.zeros(n, n, dtype=torch.int64)
    and_ = idx[:, None] & idx[None, :]
    while bool(and_.any()):
        parity ^= and_ & 1
        and_ = and_ >> 1
    return (1 - 2 * parity).to(dtype=dtype, device=device)


def fwht(y: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh–Hadamard transform along the last dim (a power of two), as
    butterflies in a fixed order: stage h = 1, 2, 4, ... replaces each pair (a, b) at
    distance h by (a + b, a − b). The order defines the float32 rounding, so the native
    kernel (kernels.c), which runs the same stages, gives the same bits."""
    *lead, n = y.shape
    m = n.bit_length() - 1
    if n != 1 << m:
        raise ValueError(f"Hadamard length {n} is not a power of two")
    x = y.reshape(-1, n)
    h = 1
    while h < n:
        pairs = x.view(-1, n // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        x = torch.stack((a + b, a - b), dim=2).view(-1, n)
        h *= 2
    return x.reshape(*lead, n)


def _inv_sqrt(n: int, dtype: torch.dtype) -> torch.Tensor:
    """1/√n rounded once to the working precision (as the native kernel does)."""
    return torch.tensor(1.0 / math.sqrt(n), dtype=dtype)


def rotate(x: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """R(x) = H·D·x/√n, row-wise for x of shape (S, n), D given by its sign masks."""
    return fwht(flip_signs(x, masks)).mul_(_inv_sqrt(x.shape[-1], x.dtype))


def unrotate(y: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """R⁻¹(y) = D·H·y/√n."""
    return flip_signs(fwht(y).mul_(_inv_sqrt(y.shape[-1], y.dtype)), masks)
