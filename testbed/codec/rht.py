"""Randomized Hadamard transform R(x) = H·D·x/√n over spans of n = 2^m coordinates.

The ±1 diagonal D comes from a counter-based hash of (seed, step, bucket, span,
coordinate), computed with integer arithmetic that never overflows int64, so the signs are
bit-identical on every host, OS, torch version and device (no torch.Generator).
H is applied as a Kronecker product H_{2^a} ⊗ H_{2^b} (two small matrix products), which
is several times faster than a butterfly FWHT in torch.
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


_BIT = torch.arange(8, dtype=torch.uint8)


def sign_bits(keys: torch.Tensor, n: int) -> torch.Tensor:
    """Sign bits (1 = negate) for spans with 64-bit `keys` (int64 tensor of shape (S,)
    holding the keys reinterpreted as signed), n coordinates each (n a multiple of 32).
    Coordinate i takes bit i mod 32 of hash word i div 32. Returns uint8 (S, n)."""
    k1 = keys & MASK32
    k2 = (keys >> 32) & MASK32
    words = torch.arange(n // 32, dtype=torch.int64, device=keys.device)
    h = _fmix32(_mul32(words[None, :], 0x9E3779B1) ^ k1[:, None])
    h = _fmix32(h ^ k2[:, None])
    byte = torch.stack([(h >> s) & 0xFF for s in (0, 8, 16, 24)], dim=-1).to(torch.uint8)
    bits = (byte[..., None] >> _BIT.to(keys.device)) & 1
    return bits.reshape(keys.shape[0], n)


def _signed64(key: int) -> int:
    return key - (1 << 64) if key >= 1 << 63 else key


def span_signs(seed: int, step: int, bucket: int, spans: range, n: int,
               device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """±1 diagonal for each span in `spans`: a (len(spans), n) tensor."""
    keys = torch.tensor([_signed64(span_key(seed, step, bucket, s)) for s in spans],
                        dtype=torch.int64, device=device)
    return 1 - 2 * sign_bits(keys, n).to(dtype)


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
    """Unnormalized Walsh–Hadamard transform along the last dim (a power of two),
    as H_{2^a} ⊗ H_{2^b}: Y = H_a · X · H_b with X the (2^a, 2^b) reshape of each row."""
    *lead, n = y.shape
    m = n.bit_length() - 1
    if n != 1 << m:
        raise ValueError(f"Hadamard length {n} is not a power of two")
    b = m // 2
    ha = hadamard(1 << (m - b), str(y.device), y.dtype)
    hb = hadamard(1 << b, str(y.device), y.dtype)
    x = y.reshape(-1, 1 << (m - b), 1 << b)
    return torch.matmul(ha, torch.matmul(x, hb)).reshape(*lead, n)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R(x) = H·D·x/√n, row-wise for x of shape (S, n)."""
    return fwht(x * signs) * (1.0 / math.sqrt(x.shape[-1]))


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """R⁻¹(y) = D·H·y/√n."""
    return fwht(y) * signs * (1.0 / math.sqrt(y.shape[-1]))
