"""`trimlab bench codec`: NMSE of every codec at every kept size, next to theory, on
Gaussian and heavy-tailed input; and the encode+decode time over tensor.clone() time."""

from __future__ import annotations

import statistics
import time

import torch

from trimlab import wire
from trimlab.codec import CODECS, CodecContext, get_codec
from trimlab.codec.embedded import distortion

SPAN = 4096
PLANE_COORDS = 1024  # B for the "k bits per coordinate" rows
TRIM_SIZES = (128, 256, 528, 1024)
MTUS = (1500, 9000)


def inputs(numel: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (numel,), generator=g) * 2 - 1
    t3 = torch.randn(numel, generator=g) / torch.sqrt(
        torch.distributions.Chi2(3.0).sample((numel,)) / 3.0)
    return {
        "gaussian": torch.randn(numel, generator=g),
        "student_t3": t3,
        "lognormal_s2": sign * torch.exp(2.0 * torch.randn(numel, generator=g)),
    }


def nmse(est: torch.Tensor, x: torch.Tensor) -> float:
    return float(((est - x) ** 2).sum() / (x ** 2).sum())


def kept_sizes(codec) -> list[dict]:
    """(label, B, body bytes kept): k bits per coordinate, then switch trim sizes."""
    rows = [{"kept": f"{k} bits/coord", "bits": k, "coords": PLANE_COORDS,
             "body_bytes": k * PLANE_COORDS // 8} for k in range(1, 9)]
    for mtu in MTUS:
        b = min(wire.max_coords(codec, mtu), SPAN)
        for size in TRIM_SIZES:
            kept = min(codec.body_bytes(b), wire.kept_body_bytes(size))
            rows.append({"kept": f"trim {size} @ mtu {mtu}", "trim_size": size, "mtu": mtu,
                         "coords": b, "body_bytes": kept})
    return rows


def nmse_table(numel: int, seed: int) -> list[dict]:
    data = inputs(numel, seed)
    rows = []
    for name in CODECS:
        codec = get_codec(name)
        for size in kept_sizes(codec):
            ctx = CodecContext(seed=seed, step=1, bucket=0, span=SPAN, coords=size["coords"])
            row = dict(codec=name, **size)
            for label, x in data.items():
                pk = codec.encode(x, ctx)
                dec = codec.decode(pk.truncated(size["body_bytes"]), ctx, numel)
                row[label] = nmse(dec.tensor, x)
            c = torch.tensor([size["coords"]])
            row["theory"] = float(codec.expected_nmse(c, torch.tensor([size["body_bytes"]]))[0])
            rows.append(row)
    return rows


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


def roundtrip(numel: int, reps: int, seed: int) -> dict:
    """Median encode, decode and clone times; the three are interleaved rep by rep so a
    noisy neighbour slows all of them alike."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    out = {}
    for name in CODECS:
        codec = get_codec(name)
        ctx = CodecContext(seed=seed, step=1, bucket=0, span=SPAN,
                           coords=min(wire.max_coords(codec, 1500), SPAN))
        pk = codec.encode(x, ctx)
        codec.decode(pk, ctx, numel)  # warm caches (Hadamard matrices, tables)
        times = {"clone": [], "encode": [], "decode": []}
        for _ in range(reps):
            times["clone"].append(_timed(x.clone))
            times["encode"].append(_timed(lambda: codec.encode(x, ctx)))
            times["decode"].append(_timed(lambda: codec.decode(pk, ctx, numel)))
        med = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {"encode_ms": round(med["encode"], 2), "decode_ms": round(med["decode"], 2),
                     "clone_ms": round(med["clone"], 3),
                     "roundtrip_over_clone": round((med["encode"] + med["decode"]) / med["clone"], 2)}
    return out


def run(quick: bool = False, seed: int = 0) -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        numel = 1 << (18 if quick else 20)
        table = nmse_table(numel, seed)
        rt = roundtrip(1 << 22, 5 if quick else 15, seed)
    finally:
        torch.set_num_threads(threads)
    emb = [r for r in table if r["codec"] == "embedded" and "bits" in r]
    targets = {
        "embedded_gaussian_le_1.1_Dk": all(r["gaussian"] <= 1.1 * distortion(r["bits"]) for r in emb),
        "embedded_1bit_heavy_tailed_le_0.40": all(r[k] <= 0.40 for r in emb if r["bits"] == 1
                                                  for k in ("student_t3", "lognormal_s2")),
        "roundtrip_over_clone_le_3": {k: v["roundtrip_over_clone"] <= 3 for k, v in rt.items()},
    }
    return {"bench": "codec", "quick": quick, "numel_nmse": numel, "numel_roundtrip": 1 << 22,
            "span": SPAN, "threads": 1, "torch": torch.__version__, "nmse": table,
            "roundtrip": rt, "targets": targets}
