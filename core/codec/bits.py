"""Bit-level packing without per-bit loops.

Bit planes use an 8×8 bit-matrix reflection on int64 words (three delta swaps, after
Hacker's Delight §7-3): eight coordinates' bytes go in, eight plane bytes come out. Plane bytes
carry coordinates MSB first (coordinate 0 in bit 7), like numpy.packbits.
Multi-byte values in a body (raw floats, sign_tail's tail words) are little-endian: every
host and accelerator we target stores them so, which makes them views instead of byte
swaps. The packet header alone is in network byte order (trimlab.wire).
"""

from __future__ import annotations

import sys

import torch

if sys.byteorder != "little":  # the uint8 <-> int64 views below assume it
    raise ImportError("trimlab.codec.bits needs a little-endian host")


def _antitranspose8_(x: torch.Tensor) -> torch.Tensor:
    """In place: reflect the 8×8 bit matrix of each int64 about its anti-diagonal, with row
    r = byte r (little-endian memory order) and column j = bit j. Fed eight values' bytes
    (value i in byte i), byte m of the result is bit 7-m of all eight values, value i in
    bit 7-i: exactly bit plane m, MSB first. It is its own inverse. The masks keep the
    sign-extended bits of the arithmetic right shifts out."""
    for shift, mask in ((36, 0x000000000F0F0F0F), (18, 0x0000333300003333),
                        (9, 0x0055005500550055)):
        t = x >> shift
        t ^= x
        t &= mask
        x ^= t
        t <<= shift
        x ^= t
    return x


def pack_planes(q: torch.Tensor, k: int) -> torch.Tensor:
    """q (P, c) integers in [0, 2^k), k ≤ 16, c a multiple of 8 → (P, k, c/8) uint8 where
    plane j holds bit k-1-j of every coordinate."""
    p, c = q.shape
    g = c // 8
    nb = (k + 7) // 8
    q = q.to(torch.int32) << (8 * nb - k)  # bit k-1 becomes the top bit of the top byte
    planes = torch.empty(p, 8 * nb, g, dtype=torch.uint8, device=q.device)
    for h in range(nb):  # value byte h, most significant first
        byte = ((q >> (8 * (nb - 1 - h))) & 0xFF).to(torch.uint8)
        words = _antitranspose8_(byte.view(p, g * 8).view(torch.int64))
        planes[:, 8 * h:8 * h + 8, :] = words.view(torch.uint8).view(p, g, 8).transpose(1, 2)
    return planes[:, :k] if k < 8 * nb else planes


def unpack_planes(planes: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of pack_planes: (P, k, c/8) uint8 → (P, c) int32 in [0, 2^k)."""
    p, _, g = planes.shape
    nb = (k + 7) // 8
    if k < 8 * nb:
        planes = torch.nn.functional.pad(planes, (0, 0, 0, 8 * nb - k))
    q = None
    for h in range(nb):
        rows = planes[:, 8 * h:8 * h + 8, :].transpose(1, 2).contiguous()
        byte = _antitranspose8_(rows.view(p, g * 8).view(torch.int64)).view(torch.uint8)
        byte = byte.view(p, g * 8).to(torch.int32)
        q = byte if q is None else (q << 8) | byte
    return q >> (8 * nb - k)


def words_to_bytes(w: torch.Tensor) -> torch.Tensor:
    """(..., n) int32 words → (..., 4n) uint8, little-endian."""
    return w.contiguous().view(torch.uint8)


def bytes_to_words(b: torch.Tensor) -> torch.Tensor:
    """(..., 4n) uint8 → (..., n) int32 words, little-endian."""
    return b.contiguous().view(torch.int32)


_J = torch.arange(31, dtype=torch.int32)


def pack31(v: torch.Tensor) -> torch.Tensor:
    """(P, c) 31-bit values (int32 ≥ 0), c a multiple of 32 → (P, 31c/32) int32 words:
    each group of 32 values is one 992-bit string, cut into 31 words of 32 bits. Word j
    holds the low 31-j bits of value j, then the top j+1 bits of value j+1. Words are bit
    patterns: a set top bit makes the int32 negative, which is fine."""
    p, c = v.shape
    v = v.to(torch.int32).reshape(p, c // 32, 32)
    j = _J.to(v.device)
    lo = v[..., :31] & ((1 << (31 - j)) - 1)
    words = (lo << (j + 1)) | (v[..., 1:] >> (30 - j))
    return words.reshape(p, -1)


def unpack31(words: torch.Tensor) -> torch.Tensor:
    """Inverse of pack31: (P, 31g) int32 words → (P, 32g) int32 31-bit values."""
    p = words.shape[0]
    w = words.reshape(p, -1, 31)
    j = _J.to(w.device)
    prev = torch.nn.functional.pad(w[..., :30], (1, 0))  # word j-1, zero for j = 0
    head = (prev & ((1 << j) - 1)) << (31 - j)
    tail = (w >> (j + 1)) & ((1 << (31 - j)) - 1)  # the mask drops sign-extended bits
    v = torch.cat([head | tail, w[..., 30:] & 0x7FFFFFFF], dim=-1)
    return v.reshape(p, -1)
