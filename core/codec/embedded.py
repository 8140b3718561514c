"""The embedded codec (default): nested Panter–Dite cells sent as bit planes.

Per packet of c rotated coordinates: σ = ‖y‖/√c goes in the header, z = y/σ,
q = ⌊2^K·Φ(z/√3)⌋ clipped to [0, 2^K−1], computed exactly as the number of thresholds
√3·Φ⁻¹(j/2^16) (one float32 table, nested for every K) that z reaches, shifted to K bits. Plane j carries bit K−1−j of every q, so the
first k planes give q ≫ (K−k), the level-k cell of z, and ẑ is that cell's N(0,1)
centroid. A trim anywhere keeps whole planes plus a prefix of the next one.
"""

from __future__ import annotations

import functools
import math

import torch

import numpy as np

from trimlab.codec import bits
from trimlab.codec.base import Codec, div_rn, lane_sum, sqrt_rn
from trimlab.errors import CodecError

SQRT3 = math.sqrt(3.0)
QBITS = 16  # the threshold table's resolution: q is computed at 16 bits, then shifted
POLY_LO, POLY_PER_UNIT, POLY_CELLS = -8.0, 16, 256  # kernels.c's cubic guess of q


@functools.lru_cache(maxsize=None)
def thresholds() -> torch.Tensor:
    """T[j] = √3·Φ⁻¹(j/2^16) in float32 for j = 1..2^16−1, T[0] = −∞, T[2^16] = +∞:
    q16 = #{j : T[j] ≤ z}. Computed once on the CPU in float64 and shared by both
    implementations and every device. The first 2^K−1 thresholds of level K are
    T[j·2^(16−K)] (the same fractions), so q = q16 ≫ (16 − K) for every K."""
    j = torch.arange(1, 1 << QBITS, dtype=torch.float64)
    inner = (SQRT3 * torch.special.ndtri(j / (1 << QBITS))).to(torch.float32)
    inf = torch.tensor([math.inf], dtype=torch.float32)
    return torch.cat([-inf, inner, inf])


@functools.lru_cache(maxsize=None)
def guess_poly() -> torch.Tensor:
    """Per cell of width 1/16 on [−8, 8): the cubic in t ∈ [0, 1) nearest to
    2^16·Φ(z/√3), z = −8 + (cell + t)/16. kernels.c starts from it and corrects the guess
    by comparisons with thresholds(), so its accuracy (≪ 1 step) never shows in q."""
    t = (np.arange(64) + 0.5) / 64
    vander = np.stack([t ** k for k in range(4)], axis=1)
    cells = np.arange(POLY_CELLS)[:, None]
    z = POLY_LO + (cells + t[None, :]) / POLY_PER_UNIT
    target = (1 << QBITS) * torch.special.ndtr(torch.from_numpy(z / SQRT3)).numpy()
    # least squares by the normal equations (4 × 4, well conditioned): einsum and a small
    # solve keep numpy's BLAS threads asleep (lstsq woke them to spin for 0.1 s after,
    # taking a core from whatever the agent does next)
    gram = np.einsum("ik,il->kl", vander, vander)
    coef = np.linalg.solve(gram, np.einsum("ik,ci->kc", vander, target))
    return torch.from_numpy(coef.T.astype(np.float32)).contiguous()


def quantize16(z: torch.Tensor) -> torch.Tensor:
    """q16 = #{j : T[j] ≤ z} (int64), z already free of NaN."""
    inner = thresholds().to(z.device)[1:-1]
    return torch.searchsorted(inner, z.contiguous(), right=True)


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
    native = True

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

    @functools.lru_cache(maxsize=8)
    def _fine(self, device: str) -> torch.Tensor:
        """The finest level's centroids alone, in cell order (kernels.c's `fine`)."""
        return self._table(device)[1::2].contiguous()

    def body_bytes(self, coords: int) -> int:
        return self.planes * coords // 8

    def native_tables(self, device):
        return {"thresholds": thresholds(), "poly": guess_poly(), "table": self._table(device),
                "fine": self._fine(device)}

    def encode_block(self, y):
        c = y.shape[1]
        sigma = sqrt_rn(div_rn(lane_sum(y * y), c))
        z = torch.where(sigma[:, None] > 0, y / sigma[:, None], torch.zeros_like(y))
        z = torch.where(torch.isnan(z), torch.zeros_like(z), z)
        q = quantize16(z) >> (QBITS - self.planes)
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
        return zhat * scale[:, None], self.present_coords(torch.full_like(length, c), length)

    def present_coords(self, coords, nbytes):
        plane = (coords // 8).clamp(min=1)
        whole = torch.clamp(nbytes // plane, max=self.planes)
        part = torch.where(whole < self.planes, nbytes - whole * plane, torch.zeros_like(nbytes))
        return torch.where(whole > 0, coords, torch.clamp(8 * part, max=coords))

    def expected_nmse(self, coords, nbytes):
        plane = (coords // 8).clamp(min=1)
        whole = torch.clamp(nbytes // plane, max=self.planes)
        frac = torch.where(whole < self.planes, (nbytes - whole * plane) / plane,
                           torch.zeros_like(nbytes, dtype=torch.float64))
        nmse = self._nmse.to(nbytes.device)
        upper = torch.clamp(whole + 1, max=self.planes)
        return (1 - frac) * nmse[whole] + frac * nmse[upper]
