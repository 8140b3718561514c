"""`trimlab bench codec`: NMSE of every codec at every kept size, next to theory, on
Gaussian and heavy-tailed input; the encode+decode time over tensor.clone() time for the
implementation in use (native kernels on CPU for the rotated codecs), the torch
reference's time beside it, and whether both put the same bytes on the wire; sign_tail
without its rotation too, which splits its ratio into the packing's and the butterflies'."""

from __future__ import annotations

import os
import statistics
import time
from contextlib import contextmanager

import torch

from trimlab import native, wire
from trimlab.agents.transport import hold_heap
from trimlab.codec import CODECS, CodecContext, get_codec, kernels
from trimlab.codec.embedded import distortion
from trimlab.errors import TrimlabError

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


def _timed(fn, sync=None) -> float:
    """Milliseconds of fn(); on a GPU between two synchronizations."""
    if sync:
        sync()
    t0 = time.perf_counter()
    fn()
    if sync:
        sync()
    return 1e3 * (time.perf_counter() - t0)


@contextmanager
def _env(name: str, value: str):
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name)
        else:
            os.environ[name] = before


def _impl(name: str):
    return _env("TRIMLAB_CODEC_IMPL", name)


def _medians(codec, x, ctx, reps: int) -> dict:
    """Median encode, decode and clone times; the three are interleaved rep by rep so a
    noisy neighbour slows all of them alike."""
    numel = x.numel()
    sync = torch.cuda.synchronize if x.is_cuda else None
    pk = codec.encode(x, ctx)
    codec.decode(pk, ctx, numel)  # warm caches (tables, the kernels' build, the allocator)
    times = {"clone": [], "encode": [], "decode": []}
    for _ in range(reps):
        times["clone"].append(_timed(x.clone, sync))
        times["encode"].append(_timed(lambda: codec.encode(x, ctx), sync))
        times["decode"].append(_timed(lambda: codec.decode(pk, ctx, numel), sync))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"encode_ms": round(med["encode"], 3), "decode_ms": round(med["decode"], 3),
            "clone_ms": round(med["clone"], 4),
            "roundtrip_over_clone": round((med["encode"] + med["decode"]) / med["clone"], 2),
            "mb_per_s": round(4 * numel / 1e3 / (med["encode"] + med["decode"]), 1),
            "encode_gb_per_s": round(4 * numel / 1e6 / med["encode"], 2),
            "decode_gb_per_s": round(4 * numel / 1e6 / med["decode"], 2)}


def _same_wire(codec, x, ctx) -> bool:
    """Native and reference encodings are identical, and so are their decodings of a trim."""
    with _impl("torch"):
        ref = codec.encode(x, ctx)
        a = codec.decode(ref.truncated(codec.body_bytes(ctx.coords) // 3), ctx, x.numel())
    with _impl("native"):
        nat = codec.encode(x, ctx)
        b = codec.decode(ref.truncated(codec.body_bytes(ctx.coords) // 3), ctx, x.numel())
    return _wire_equal(ref, nat) and torch.equal(a.tensor, b.tensor)


def _wire_equal(a, b) -> bool:
    """Two encodings (Packets, on any devices) put the same scales, bodies and lengths on the wire."""
    return all(torch.equal(getattr(a, f), getattr(b, f).to(getattr(a, f).device)) for f in ("scale", "body", "length"))


def _context(codec, seed: int) -> CodecContext:
    """The timed buckets' context: spans of SPAN, packets as large as MTU 1500 allows."""
    return CodecContext(seed=seed, step=1, bucket=0, span=SPAN, coords=min(wire.max_coords(codec, 1500), SPAN))


def _timed_on(codec, x: torch.Tensor, ctx: CodecContext, reps: int, threads: int) -> dict:
    """The implementation in use for `codec`, timed (its kernels on `threads` threads)."""
    impl = codec.implementation("cpu")
    kernels.set_threads(threads)
    try:
        return {"implementation": impl, "threads": threads if impl == "native" else 1,
                **_medians(codec, x, ctx, reps)}
    finally:
        kernels.set_threads(1)


def roundtrip(x: torch.Tensor, reps: int, seed: int, threads: int = 1) -> dict:
    """Per codec: the implementation in use, timed, the torch reference timed alike on one
    thread (fewer repeats: it is slow), and the bytes."""
    out = {}
    for name in CODECS:
        codec = get_codec(name)
        ctx = _context(codec, seed)
        out[name] = _timed_on(codec, x, ctx, reps, threads)
        if out[name]["implementation"] == "native":
            with _impl("torch"):
                ref = _medians(codec, x, ctx, max(1, reps // 5))
            out[name]["torch_reference"] = ref
            out[name]["speedup_over_torch"] = round(
                (ref["encode_ms"] + ref["decode_ms"]) / (out[name]["encode_ms"] + out[name]["decode_ms"]), 1)
            out[name]["native_bytes_equal_torch"] = _same_wire(codec, x[:1 << 16], ctx)
    return out


def without_rotation(x: torch.Tensor, reps: int, seed: int, rotated: dict, threads: int = 1) -> dict:
    """sign_tail's packing alone: the codec without its rotation (coded straight from the
    input), timed as `roundtrip` times the codecs. Beside the rotated codec's figures (in
    `rotated`) it splits the ratio into the packing's share and the butterflies'."""
    codec = get_codec("sign_tail", rotate=False)
    out = {"codec": "sign_tail", "rotate": False, **_timed_on(codec, x, _context(codec, seed), reps, threads)}
    out["butterflies_over_clone"] = round(rotated["roundtrip_over_clone"] - out["roundtrip_over_clone"], 2)
    return out


def isa_levels(asked: str) -> list[str]:
    """`--isa`: a comma-separated list of native levels, or `all` (every level this CPU
    runs, best first); a level this CPU cannot run is an error naming what it lacks."""
    runs = [i.name for i in native.runnable()]
    levels = runs if asked == "all" else [a.strip() for a in asked.split(",") if a.strip()]
    for level in levels:
        if level not in native.ISAS:
            raise TrimlabError(f"--isa {level}: choose from {', '.join(native.ISAS)} or all")
        if level not in runs:
            lacks = " ".join(sorted(native.ISAS[level].needs - native.host_features()))
            raise TrimlabError(f"--isa {level}: this CPU cannot run it (it lacks {lacks}; it runs {', '.join(runs)})")
    return levels


def by_isa(levels: list[str], x: torch.Tensor, reps: int, seed: int) -> dict:
    """The natively coded codecs on each vector path, side by side in one run: times and
    ratios (each path's clone measured with it), and its bytes against the reference."""
    out = {}
    for level in levels:
        with _env("TRIMLAB_ISA", level):
            rows: dict = {"built_for": kernels.isa().name}
            for name in CODECS:
                codec = get_codec(name)
                ctx = _context(codec, seed)
                if codec.implementation("cpu") == "native":
                    rows[name] = {**_medians(codec, x, ctx, reps),
                                  "native_bytes_equal_torch": _same_wire(codec, x[:1 << 16], ctx)}
            out[level] = rows
    return out


def cuda(sizes: tuple[int, ...], reps: int, seed: int) -> dict:
    """The torch implementation on the GPU: its wire bytes against the CPU's (the native
    kernels where they code), its decoding of a trim against the CPU's, and its speed."""
    if not torch.cuda.is_available():
        raise TrimlabError("--device cuda: torch sees no CUDA device here; run it on a machine with a GPU")
    out: dict = {"gpu": torch.cuda.get_device_name(), "sizes": {}}
    for numel in sizes:
        x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
        xc = x.cuda()
        rows = {}
        for name in CODECS:
            codec = get_codec(name)
            ctx = _context(codec, seed)
            here, there = codec.encode(x, ctx), codec.encode(xc, ctx)
            same = _wire_equal(here, there)
            cut = codec.body_bytes(ctx.coords) // 3
            a = codec.decode(here.truncated(cut), ctx, numel).tensor
            b = codec.decode(there.truncated(cut), ctx, numel).tensor.cpu()
            rows[name] = {"implementation_cpu": codec.implementation("cpu"),
                          "implementation_cuda": codec.implementation(xc.device),
                          "cuda_bytes_equal_cpu": same, "trimmed_decode_equal_cpu": torch.equal(a, b),
                          "trimmed_decode_max_abs_diff": float((a - b).abs().max()),
                          **_medians(codec, xc, ctx, reps)}
        out["sizes"][str(numel)] = rows
    out["cuda_bytes_equal_cpu"] = all(r["cuda_bytes_equal_cpu"] for s in out["sizes"].values() for r in s.values())
    return out


def run(quick: bool = False, seed: int = 0, threads: int = 1, device: str = "cpu", isa: str | None = None) -> dict:
    if device not in ("cpu", "cuda"):
        raise TrimlabError(f"--device {device}: use cpu or cuda")
    levels = isa_levels(isa) if isa else []
    if device == "cuda":  # the GPU's figures only; the NMSE table is the CPU's business
        return {"bench": "codec", "device": "cuda", "quick": quick, "span": SPAN, "torch": torch.__version__,
                "cuda": cuda((1 << 22,) if quick else (1 << 22, 1 << 26), 10 if quick else 20, seed)}
    # the agents' allocator setting: without it a fresh 16 MB clone (or codec output)
    # page-faults in some repeats and not in others (2.1 against 6.8 ms here), and the
    # ratio follows the allocator, not the codec
    hold_heap()
    torch_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        numel = 1 << (18 if quick else 20)
        table = nmse_table(numel, seed)
        x = torch.randn(1 << 22, generator=torch.Generator().manual_seed(seed))
        rt = roundtrip(x, 5 if quick else 15, seed, threads)
        unrotated = without_rotation(x, 5 if quick else 15, seed, rt["sign_tail"], threads)
        paths = by_isa(levels, x, 5 if quick else 15, seed) if levels else None
    finally:
        torch.set_num_threads(torch_threads)
    emb = [r for r in table if r["codec"] == "embedded" and "bits" in r]
    targets = {
        "embedded_gaussian_le_1.1_Dk": all(r["gaussian"] <= 1.1 * distortion(r["bits"]) for r in emb),
        "embedded_1bit_heavy_tailed_le_0.40": all(r[k] <= 0.40 for r in emb if r["bits"] == 1
                                                  for k in ("student_t3", "lognormal_s2")),
        "roundtrip_over_clone_le_3": {k: v["roundtrip_over_clone"] <= 3 for k, v in rt.items()},
        "native_bytes_equal_torch": all(v.get("native_bytes_equal_torch", True) for v in rt.values()),
    }
    return {"bench": "codec", "quick": quick, "numel_nmse": numel, "numel_roundtrip": 1 << 22,
            "span": SPAN, "threads": threads, "torch": torch.__version__, "nmse": table,
            "roundtrip": rt, "sign_tail_without_rotation": unrotated, "targets": targets,
            **({"by_isa": paths} if paths is not None else {})}
