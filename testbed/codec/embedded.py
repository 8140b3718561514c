"""The embedded codec (default): nested Panter–Dite cells sent as bit planes.

Per packet of c rotated coordinates: σ = ‖y‖/√c goes in the header, z = y/σ,
q = ⌊2^K·Φ(z/√3)⌋ clipped to [0, 2^K−1]. Plane j carries bit K−1−j of every q, so the
first k planes give q ≫ (K−k), the level-k cell of z, and ẑ is that cell's N(0,1)
centroid. A trim anywhere keeps whole planes plus a prefix of the next one.
"""

from __future__ import annotations

import functools
import math

import torch

from trimlab.codec import bits
from trimlab.codec.base import Codec
from trimlab.errors import CodecError

SQRT3 = math.sqrt(3.0)


@functools.lru_cache(maxsize=None)
def _tables64(k_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Centroids of every level k = 0..k_max, concatenated (level k at offset 2^k − 1),
    and D_k = E[(z − ẑ)²] for z ~ N(0,1), in float64. Only the lower half of each level
    is computed; the upper half mirrors it (exact, and free of cancellation)."""
    cents = [torch.zeros(1, dtype=torch.float64)]
    dist = [1.0]
    for k in range(1, k_max + 1):
        half = 1 << (k - 1)
        edges = torch.arange(half + 1, dtype=torch.float64) / (1 << k)
        t = SQRT3 * torch.special.ndtri(edges)  # -inf .. 0
        cdf = torch.special.ndtr(t)
        pdf = torch.exp(-0.5 * t * t) / math.sqrt(2 * math.pi)
        prob = cdf[1:] - cdf[:-1]
        lower = (pdf[:-1] - pdf[1:]) / prob
        cents.append(torch.cat([lower, -lower.flip(0)]))
        dist.append(1.0 - 2.0 * float((prob * lower * lower).sum()))
    return torch.cat(cents), torch.tensor(dist, dtype=torch.float64)


def distortion(k: int) -> float:
    """D_k: the per-coordinate NMSE of k planes on N(0,1) input (biased centroids)."""
    return float(_tables64(max(k, 1))[1][k])


class Embedded(Codec):
    name = "embedded"
    codec_id = 4
    rotated = True
    prescaled = True

    def __init__(self, planes: int = 16, unbiased: bool = False):
        if not 1 <= planes <= 16:
            raise CodecError(f"embedded: planes={planes}: must be 1..16")
        self.planes = int(planes)
        self.unbiased = bool(unbiased)
        cents, dist = _tables64(self.planes)
        # NMSE of level k: D_k biased, D_k/(1−D_k) when ẑ is divided by (1 − D_k).
        if self.unbiased:
            gain = torch.where(dist < 1, 1.0 / (1.0 - dist), torch.zeros_like(dist))
            level_of = torch.repeat_interleave(torch.arange(self.planes + 1),
                                               2 ** torch.arange(self.planes + 1))
            cents = cents * gain[level_of]
            self._nmse = torch.where(dist < 1, dist / (1.0 - dist), torch.ones_like(dist))
        else:
            self._nmse = dist
        # Centroids keyed by v = (2·j + 1)·2^(K−k) for cell j of level k: the known bits of
        # q, a one, then zeros. With q zero-filled past what arrived, v = 2q | 2^(K−k),
        # so decoding needs one gather, whatever mix of levels a packet holds.
        k_all = self.planes
        table = torch.zeros(2 << k_all, dtype=torch.float64)
        for k in range(k_all + 1):
            j = torch.arange(1 << k)
            table[(2 * j + 1) << (k_all - k)] = cents[(1 << k) - 1 + j]
        self._table64 = table

    def params(self) -> dict:
        return {"planes": self.planes, "unbiased": self.unbiased}

    @functools.lru_cache(maxsize=8)
    def _table(self, device: str) -> torch.Tensor:
        return self._table64.to(device=device, dtype=torch.float32)

    def body_bytes(self, coords: int) -> int:
        return self.planes * coords // 8

    def encode_block(self, y):
        c = y.shape[1]
        sigma = torch.linalg.vector_norm(y, dim=1) / math.sqrt(c)
        # Φ(z/√3) = (1 + erf(y / (σ√6))) / 2; erf is several times faster than ndtr.
        inv = torch.where(sigma > 0, 1.0 / (sigma * math.sqrt(6.0)), torch.zeros_like(sigma))
        half = float(1 << (self.planes - 1))
        u = torch.erf(y * inv[:, None]).mul_(half).add_(half)
        q = u.to(torch.int32).clamp_(max=(1 << self.planes) - 1)  # u ≥ 0: truncation is floor
        return bits.pack_planes(q, self.planes).reshape(y.shape[0], -1), sigma

    def decode_block(self, body, length, scale):
        p = body.shape[0]
        k = self.planes
        plane = body.shape[1] // k
        c = plane * 8
        q = bits.unpack_planes(body.reshape(p, k, plane), k)
        whole = torch.clamp(length // plane, max=k)
        part = torch.where(whole < k, length - whole * plane, torch.zeros_like(length))
        # The marker bit 2^(K−level): level = whole, plus one for the partial plane's prefix.
        marker = (1 << (k - whole)).to(torch.int32)[:, None]
        refined = torch.arange(c, device=body.device)[None, :] < 8 * part[:, None]
        v = (q << 1) | (marker >> refined.to(torch.int32))
        zhat = self._table(str(body.device)).index_select(0, v.reshape(-1)).view(p, c)
        present = torch.where(whole > 0, torch.full_like(whole, c), 8 * part)
        return zhat * scale[:, None], present

    def expected_nmse(self, coords, nbytes):
        plane = (coords // 8).clamp(min=1)
        whole = torch.clamp(nbytes // plane, max=self.planes)
        frac = torch.where(whole < self.planes, (nbytes - whole * plane) / plane,
                           torch.zeros_like(nbytes, dtype=torch.float64))
        nmse = self._nmse.to(nbytes.device)
        upper = torch.clamp(whole + 1, max=self.planes)
        return (1 - frac) * nmse[whole] + frac * nmse[upper]
