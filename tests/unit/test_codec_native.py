"""The native codec kernels (kernels.c) put the same bytes on the wire as the torch
reference and decode every truncation to the same values — built for every vector level
this CPU can run (AVX-512 with GFNI and VBMI, AVX-512, AVX2) and without any (the plain C
path of other CPUs); levels the CPU cannot run are skipped, saying which features it lacks."""

import ctypes
import dataclasses

import numpy as np
import pytest
import torch

from trimlab import native as build
from trimlab import resources, wire
from trimlab.codec import CodecContext, get_codec, rht
from trimlab.codec import kernels as native
from trimlab.codec.base import sqrt_rn
from trimlab.codec.embedded import guess_poly, quantize16, thresholds

VARIANTS = [("embedded", {}), ("embedded", {"planes": 8}), ("embedded", {"planes": 1}),
            ("embedded", {"unbiased": True}), ("sign_tail", {}), ("sign_tail", {"unbiased": True}),
            ("sign_tail", {"rotate": False}), ("fp32", {}), ("bf16", {})]
IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in p.items()) or 'default'}" for n, p in VARIANTS]
FIELDS = ("span", "index", "coords", "scale", "body", "length")


@pytest.fixture(params=list(build.ISAS))
def kernels(request, monkeypatch):
    """The kernels built for each vector level (AVX-512 with GFNI and VBMI, AVX-512, AVX2,
    plain C); a level this CPU cannot execute is skipped, never called."""
    levels = [isa.name for isa in build.runnable()]
    if request.param not in levels:
        pytest.skip(f"this CPU cannot run the {request.param} kernels (it lacks "
                    f"{' '.join(sorted(build.ISAS[request.param].needs - build.host_features()))})")
    monkeypatch.setenv("TRIMLAB_ISA", request.param)
    monkeypatch.setenv("TRIMLAB_CODEC_IMPL", "native")
    yield request.param


def _both(monkeypatch, fn):
    monkeypatch.setenv("TRIMLAB_CODEC_IMPL", "torch")
    ref = fn()
    monkeypatch.setenv("TRIMLAB_CODEC_IMPL", "native")
    return ref, fn()


def _inputs():
    g = torch.Generator().manual_seed(7)
    heavy = torch.randn(3000, generator=g) * torch.exp(3 * torch.randn(3000, generator=g))
    spiky = torch.zeros(5000)
    spiky[::997] = 1e3
    return {"gaussian": (torch.randn(4096 * 3 + 77, generator=g), CodecContext(1, 2, 3, 4096, 1024)),
            "odd_sizes": (torch.randn(1, generator=g), CodecContext(1, 2, 3, 256, 96)),
            "tail": (torch.randn(1000, generator=g), CodecContext(9, 1, 0, 512, 160)),
            "heavy": (heavy, CodecContext(2, 5, 1, 1024, 352)),
            "spiky": (spiky, CodecContext(2, 5, 1, 2048, 704)),
            "tiny": (torch.randn(2048, generator=g) * 1e-30, CodecContext(0, 0, 0, 1024, 256)),
            "huge": (torch.randn(2048, generator=g) * 1e30, CodecContext(0, 0, 0, 1024, 256)),
            "zeros": (torch.zeros(700), CodecContext(0, 0, 0, 256, 128)),
            # spans of every pass plan of the butterflies (the first pass alone, with 1 to
            # 4 stages after the in-register ones: spans 32 to 256; 4 + 2 + 2 + 2 at 16 384)
            "span_32": (torch.randn(70, generator=g), CodecContext(3, 1, 2, 32, 32)),
            "span_64": (torch.randn(130, generator=g), CodecContext(3, 1, 2, 64, 32)),
            "span_128": (torch.randn(200, generator=g), CodecContext(3, 1, 2, 128, 64)),
            "span_16k": (torch.randn(16384 + 40, generator=g), CodecContext(3, 1, 2, 16384, 1024)),
            # many packets of a size whose scale needs a correctly rounded square root
            "many": (torch.randn(1 << 18, generator=g), CodecContext(4, 5, 1, 4096, 480))}


@pytest.mark.unit
@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_native_bytes_and_values_equal_the_reference(kernels, monkeypatch, name, params):
    codec = get_codec(name, **params)
    for label, (x, ctx) in _inputs().items():
        ref, nat = _both(monkeypatch, lambda: codec.encode(x, ctx))
        for f in FIELDS:
            assert torch.equal(getattr(ref, f), getattr(nat, f)), (label, f)
        full = codec.body_bytes(ctx.coords)
        for cut in sorted({0, 1, 4, 12, 40, 132, full // 2, full - 4, full}):
            pk = ref.truncated(cut)
            a, b = _both(monkeypatch, lambda: codec.decode(pk, ctx, x.numel()))
            assert torch.equal(a.tensor, b.tensor), (label, cut)
            assert torch.equal(a.missing, b.missing), (label, cut)


@pytest.mark.unit
@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_frames_hold_the_same_bytes_either_way(kernels, monkeypatch, name, params):
    """packetize_frames has the codec write bodies in place, rows strided by the header in
    front of each: the same frames from the kernels as from the reference."""
    codec = get_codec(name, **params)
    grad = torch.randn(3 * 4096 + 999, generator=torch.Generator().manual_seed(5))
    ref, nat = _both(monkeypatch, lambda: wire.packetize_frames(grad, codec, 1500, 352, 4096,
                                                                wire.PacketIds(1, 2, 3, 4), 7))
    assert np.array_equal(ref.data, nat.data) and np.array_equal(ref.length, nat.length)


@pytest.mark.unit
def test_sqrt_is_correctly_rounded():

    q = torch.cat([torch.rand(1 << 20, generator=torch.Generator().manual_seed(3)) * 4,
                   torch.tensor([0.0, 1.0, 2.0, 1e-30, 3e38, 2.115628682076931e-3])])
    assert torch.equal(sqrt_rn(q), torch.from_numpy(np.sqrt(q.numpy())))


@pytest.mark.unit
def test_native_decodes_any_subset_in_any_order(kernels, monkeypatch):
    codec = get_codec("embedded")
    x, ctx = _inputs()["gaussian"]
    pk = codec.encode(x, ctx)
    order = torch.randperm(len(pk), generator=torch.Generator().manual_seed(1))[:len(pk) - 3]
    sub = pk.select(order)
    sub.length = torch.randint(0, codec.body_bytes(ctx.coords) + 1, (len(sub),),
                               generator=torch.Generator().manual_seed(2))
    a, b = _both(monkeypatch, lambda: codec.decode(sub, ctx, x.numel()))
    assert torch.equal(a.tensor, b.tensor) and torch.equal(a.missing, b.missing)
    assert a.missing.any() and not a.missing.all()


@pytest.mark.unit
def test_non_finite_buckets_stay_non_finite(kernels):
    for name in ("embedded", "sign_tail", "fp32", "bf16"):
        codec = get_codec(name)
        ctx = CodecContext(0, 0, 0, 1024, 256)
        for bad in (float("nan"), float("inf")):
            x = torch.randn(4096)
            x[100] = bad
            dec = codec.decode(codec.encode(x, ctx), ctx, x.numel())
            assert not torch.isfinite(dec.tensor[:1024]).all(), (name, bad)


@pytest.mark.unit
def test_threads_give_the_same_bytes(kernels, monkeypatch):
    codec = get_codec("embedded")
    x, ctx = _inputs()["gaussian"]
    one = codec.encode(x, ctx)
    monkeypatch.setattr(native, "_threads", 3)
    three = codec.encode(x, ctx)
    assert torch.equal(one.body, three.body) and torch.equal(one.scale, three.scale)
    assert torch.equal(codec.decode(one, ctx, x.numel()).tensor, codec.decode(three, ctx, x.numel()).tensor)


@pytest.mark.unit
def test_span_keys_and_guess_agree_with_python(kernels):
    for args in [(0, 0, 0, 0), (1, 2, 3, 4), (2**64 - 1, 7, 2**40, 65535)]:
        assert native.span_key(*args) == rht.span_key(*args)
    # the quantizer's guess (a cubic per cell, or a polynomial per half-unit on AVX-512 and AVX2) is
    # corrected to the exact count everywhere: at every threshold, one float either side,
    # and densely between
    t = thresholds()[1:-1]
    z = torch.cat([torch.linspace(-20, 20, 400001), t, torch.nextafter(t, torch.tensor(-float("inf"))),
                   torch.nextafter(t, torch.tensor(float("inf"))), torch.tensor([0.0, -0.0, 1e-40, -1e-40])])
    out = torch.empty(z.numel(), dtype=torch.int16)
    lib = native._lib()
    lib.tl_quantize16(ctypes.c_void_p(thresholds().data_ptr()), ctypes.c_void_p(guess_poly().data_ptr()),
                      ctypes.c_void_p(z.data_ptr()), ctypes.c_int64(z.numel()), ctypes.c_void_p(out.data_ptr()))
    assert torch.equal(out.to(torch.int64) & 0xFFFF, quantize16(z))


@pytest.mark.unit
def test_the_quantizers_unambiguous_guess_is_exact_for_every_float(kernels):
    """Vector builds (AVX-512, AVX2) take the guess's cell without the thresholds where the
    guess is far from the cell's ends: over every float32 that cell is the thresholds' own
    (a proof by exhaustion, some seconds, for each build's own guess). They guess from
    y·(1/σ), at most 3 float steps from y/σ: every float within 4 steps of a threshold is
    ambiguous, so the product's cell is the quotient's (and 1 000 steps is far enough for
    the check to find unambiguous ones). The plain build, without the path, says so with −1."""
    lib = native._lib()
    lib.tl_fast_cell_misses.restype = ctypes.c_int64
    lib.tl_threshold_neighbours_unambiguous.restype = ctypes.c_int64
    table = ctypes.c_void_p(thresholds().data_ptr())
    misses = lib.tl_fast_cell_misses(table, ctypes.c_int64(1))
    near = [lib.tl_threshold_neighbours_unambiguous(table, ctypes.c_int(steps)) for steps in (4, 1000)]
    vector = kernels != "plain"
    assert misses == (0 if vector else -1)
    assert near[0] == (0 if vector else -1) and (near[1] > 0 if vector else near[1] == -1)


@pytest.mark.unit
@pytest.mark.parametrize("unbiased", [False, True])
def test_the_finest_centroids_are_antisymmetric(unbiased):
    """The decode kernel gathers a whole packet's centroids from the lower half of `fine`
    and negates them for the upper half: exact only while the table mirrors itself."""
    fine = get_codec("embedded", unbiased=unbiased).native_tables("cpu")["fine"]
    assert fine.numel() == 1 << 16 and torch.equal(fine, -fine.flip(0))


@pytest.mark.unit
def test_the_kernels_ship_and_report_their_build():
    src = resources.c_source("codec", "kernels.c")
    assert src.is_file()
    lib, isa = build.load_library(src, "codec", native.FLAGS)
    assert lib.tl_job_size() == ctypes.sizeof(native._Job) and isa == native.isa() == build.runnable()[0]
    assert get_codec("embedded").implementation("cpu") == "native"
    assert get_codec("bf16").implementation("cpu") == "native"
    assert get_codec("embedded").implementation("meta") == "torch"  # other devices: the reference


@pytest.mark.unit
def test_c_and_python_number_the_codecs_alike():
    """kernels.c's codec numbers are the wire's codec ids: one numbering everywhere."""
    import re
    from trimlab.codec import CODECS
    text = resources.c_source("codec", "kernels.c").read_text()
    defines = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (FP32|BF16|SIGN_TAIL|EMBEDDED) (\d+)", text, re.M)}
    assert defines == {name.upper(): c.codec_id for name, c in CODECS.items()}
    assert all(c.native for c in CODECS.values())


@pytest.mark.unit
def test_encoded_packets_are_the_callers_own():
    """The native encode hands out copies of the layout's cached skeleton, and decode of
    its cached planes: a caller that edits them in place (as collectors and tests do)
    changes no later encode or decode."""
    codec = get_codec("embedded")
    x, ctx = _inputs()["tail"]
    fields = ("span", "index", "coords", "length")
    first = codec.encode(x, ctx)
    want, decoded = [getattr(first, f).clone() for f in fields], codec.decode(first, ctx, x.numel())
    planes = decoded.stats["planes"].clone()
    for f in fields:
        getattr(first, f).fill_(-3)
    decoded.stats["planes"].fill_(-3)  # (a decode's stats are the caller's too)
    again = codec.encode(x, ctx)
    assert all(torch.equal(getattr(again, f), w) for f, w in zip(fields, want))
    redecoded = codec.decode(again, ctx, x.numel())
    assert torch.equal(redecoded.tensor, decoded.tensor) and torch.equal(redecoded.stats["planes"], planes)


@pytest.mark.parametrize("impl", ["native", "torch"])
@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_decode_in_order_is_decode_of_what_came(monkeypatch, impl, name, params):
    """Packets in the layout's order, all whole, or some never come (length -1) and some
    trimmed, and a non-finite scale in one span: the same tensor, mask and per-row stats
    as decode() of the rows that came, for every input shape (tail spans, tail packets)."""
    monkeypatch.setenv("TRIMLAB_CODEC_IMPL", impl)
    codec = get_codec(name, **params)
    rng = np.random.default_rng(3)
    for label, (x, ctx) in _inputs().items():
        pk = codec.encode(x, ctx)
        n = len(pk)
        length = pk.length.clone()
        cut = torch.from_numpy(rng.random(n) < 0.3)
        length[cut] = torch.from_numpy(rng.integers(0, pk.body.shape[1] + 1, n))[cut]
        for gone in (None, torch.zeros(n, dtype=torch.bool), torch.from_numpy(rng.random(n) < 0.25)):
            got = pk.length.clone() if gone is None else length.masked_fill(gone, -1)  # (None: all came whole)
            scale = pk.scale.clone()
            if label == "heavy" and codec.prescaled:
                scale[n // 2] = float("nan")
            ordered = dataclasses.replace(pk, length=got, scale=scale)
            dec = codec.decode_in_order(ordered, ctx, x.numel())
            came = (got >= 0).nonzero().squeeze(1)
            # decode()'s own way, which looks each packet's place up (decode() takes the
            # in-order way itself when nothing is missing)
            ref = codec._decode_any(ordered.select(came), ctx, x.numel(), impl == "native")
            assert torch.equal(dec.tensor.nan_to_num(7.0), ref.tensor.nan_to_num(7.0)), label
            assert torch.equal(dec.missing, ref.missing), label
            for k, v in ref.stats.items():
                assert torch.equal(dec.stats[k][came], v) and not dec.stats[k][got < 0].any(), (label, k)


@pytest.mark.unit
def test_bench_codec_times_every_vector_path_the_cpu_runs_side_by_side(monkeypatch):
    """`trimlab bench codec --isa`: each level's kernels are the ones built for it, their
    bytes equal the reference's; a level the CPU lacks is refused naming what it lacks."""
    from trimlab.bench import codec as bench
    from trimlab.errors import TrimlabError
    levels = bench.isa_levels("all")
    assert levels == [i.name for i in build.runnable()] and levels[-1] == "plain"
    x = torch.randn(1 << 16, generator=torch.Generator().manual_seed(3))
    out = bench.by_isa(levels, x, reps=1, seed=3)
    for level in levels:
        assert out[level]["built_for"] == level
        assert {n for n in out[level] if n != "built_for"} == {"embedded", "sign_tail", "fp32", "bf16"}
        assert all(r["native_bytes_equal_torch"] and r["roundtrip_over_clone"] > 0
                   for n, r in out[level].items() if n != "built_for")
    monkeypatch.setenv("TRIMLAB_CPU_FEATURES_OFF", "avx2")  # a CPU without AVX2
    with pytest.raises(TrimlabError, match="--isa avx2: this CPU cannot run it \\(it lacks avx2"):
        bench.isa_levels("avx2")
