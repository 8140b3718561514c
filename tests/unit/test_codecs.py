import hashlib
import subprocess
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trimlab.codec import CODECS, CodecContext, Packets, get_codec, packing
from trimlab.codec.embedded import distortion
from trimlab.errors import CodecError

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
CTX = CodecContext(seed=3, step=11, bucket=2, span=4096, coords=1024)
VARIANTS = [("embedded", {}), ("embedded", {"unbiased": True}), ("embedded", {"planes": 8}),
            ("sign_tail", {}), ("sign_tail", {"unbiased": True}), ("sign_tail", {"rotate": False}),
            ("fp32", {}), ("bf16", {})]
IDS = [f"{n}{'-' + '-'.join(f'{k}={v}' for k, v in p.items()) if p else ''}" for n, p in VARIANTS]


def nmse(est, x):
    return float(((est - x) ** 2).sum() / (x ** 2).sum())


@pytest.fixture(scope="module")
def gaussian():
    return torch.randn(1 << 18, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("bits_kept", [0.5, 1, 2, 3, 4, 6, 8])
def test_nmse_matches_theory(gaussian, name, params, bits_kept):
    codec = get_codec(name, **params)
    pk = codec.encode(gaussian, CTX)
    kept = int(bits_kept * CTX.coords / 8)
    dec = codec.decode(pk.truncated(kept), CTX, gaussian.numel())
    theory = float(codec.expected_nmse(pk.coords, dec.stats["bytes"]).mean())
    assert nmse(dec.tensor, gaussian) == pytest.approx(theory, rel=0.03, abs=1e-9)


@pytest.mark.parametrize("k", range(1, 9))
def test_embedded_k_planes_within_10_percent_of_Dk(gaussian, k):
    codec = get_codec("embedded")
    dec = codec.decode(codec.encode(gaussian, CTX).truncated(k * CTX.coords // 8), CTX, gaussian.numel())
    assert nmse(dec.tensor, gaussian) <= 1.1 * distortion(k)


def test_distortion_table_matches_design():
    design = {1: 0.363, 2: 0.124, 3: 0.0363, 4: 0.0098, 6: 6.5e-4, 8: 4.1e-5, 10: 2.6e-6, 12: 1.6e-7}
    for k, d in design.items():
        assert distortion(k) == pytest.approx(d, rel=0.03)


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_every_4_byte_truncation_decodes_and_error_never_grows(name, params):
    codec = get_codec(name, **params)
    ctx = CodecContext(seed=1, step=2, bucket=0, span=1024, coords=256)
    x = torch.randn(64 * 256, generator=torch.Generator().manual_seed(5))
    pk = codec.encode(x, ctx)
    full = codec.body_bytes(256)
    errors = []
    for cut in range(0, full + 1, 4):
        dec = codec.decode(pk.truncated(cut), ctx, x.numel())
        assert dec.tensor.shape == x.shape and torch.isfinite(dec.tensor).all()
        errors.append(nmse(dec.tensor, x))
    for fewer, more in zip(errors, errors[1:]):
        assert more <= fewer + 1e-12
    assert errors[0] == pytest.approx(1.0)  # header only: nothing known
    for cut in (1, 3, 5, 31, full - 1):  # off-boundary cuts decode too
        codec.decode(pk.truncated(cut), ctx, x.numel())


@pytest.mark.parametrize("name,params", [("fp32", {}), ("sign_tail", {"rotate": False})])
def test_untrimmed_raw_layouts_decode_exactly(gaussian, name, params):
    codec = get_codec(name, **params)
    dec = codec.decode(codec.encode(gaussian, CTX), CTX, gaussian.numel())
    assert torch.equal(dec.tensor, gaussian) and not dec.missing.any()


def test_untrimmed_rotated_sign_tail_is_exact_up_to_rounding(gaussian):
    codec = get_codec("sign_tail")
    dec = codec.decode(codec.encode(gaussian, CTX), CTX, gaussian.numel())
    assert nmse(dec.tensor, gaussian) < 1e-12


def test_bf16_is_round_to_nearest(gaussian):
    codec = get_codec("bf16")
    dec = codec.decode(codec.encode(gaussian, CTX), CTX, gaussian.numel())
    assert torch.equal(dec.tensor, gaussian.to(torch.bfloat16).float())


def test_sign_tail_head_is_drive_one_bit(gaussian):
    for unbiased, want in ((False, 0.3634), (True, 0.5708)):
        codec = get_codec("sign_tail", unbiased=unbiased)
        dec = codec.decode(codec.encode(gaussian, CTX).truncated(CTX.coords // 8), CTX, gaussian.numel())
        assert nmse(dec.tensor, gaussian) == pytest.approx(want, rel=0.02)


@pytest.mark.parametrize("name", ["embedded", "sign_tail"])
def test_unbiased_option_is_unbiased(name):
    x = torch.randn(4096, generator=torch.Generator().manual_seed(9))
    for unbiased, gain in ((True, 1.0), (False, 2 / torch.pi)):
        codec = get_codec(name, unbiased=unbiased)
        total = torch.zeros_like(x)
        for step in range(200):
            ctx = CodecContext(seed=1, step=step, span=4096, coords=1024)
            total += codec.decode(codec.encode(x, ctx).truncated(128), ctx, x.numel()).tensor
        mean = total / 200
        assert float(mean @ x / (x @ x)) == pytest.approx(gain, abs=0.02)


@pytest.mark.parametrize("numel", [1, 31, 33, 1000, 4095, 4097, 10000])
@pytest.mark.parametrize("name", list(CODECS))
def test_any_bucket_size_roundtrips(name, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    codec = get_codec(name)
    ctx = CodecContext(span=4096, coords=704)
    pk = codec.encode(x, ctx)
    assert int(pk.coords.sum()) >= numel and (pk.coords % 32 == 0).all()
    dec = codec.decode(pk, ctx, numel)
    assert dec.tensor.shape == (numel,) and not dec.missing.any()
    assert nmse(dec.tensor, x) < 1e-5


def test_lost_packet_marks_its_span_missing_for_rotated_codecs():
    x = torch.randn(3 * 4096)
    codec = get_codec("embedded")
    pk = codec.encode(x, CTX)
    lost = (pk.span == 1) & (pk.index == 2)
    dec = codec.decode(pk.select(~lost), CTX, x.numel())
    assert dec.missing[4096:8192].all() and not dec.missing[:4096].any() and not dec.missing[8192:].any()
    assert nmse(dec.tensor[:4096], x[:4096]) < 1e-8  # other spans unharmed
    assert nmse(dec.tensor[4096:8192], x[4096:8192]) == pytest.approx(0.25, abs=0.05)  # 1 of 4 lost


def test_raw_codecs_mark_exactly_the_lost_and_cut_coordinates():
    x = torch.randn(2 * 4096)
    codec = get_codec("fp32")
    pk = codec.encode(x, CTX)
    lost = (pk.span == 0) & (pk.index == 1)
    cut = pk.select(~lost)
    cut.length[-1] = 40  # last packet keeps 10 coordinates
    dec = codec.decode(cut, CTX, x.numel())
    want = torch.zeros(x.numel(), dtype=torch.bool)
    want[1024:2048] = True
    want[-1024 + 10:] = True
    assert torch.equal(dec.missing, want)
    assert torch.equal(dec.tensor[~want], x[~want])
    assert int(dec.stats["present"][-1]) == 10


def test_embedded_below_one_plane_refines_a_prefix():
    x = torch.randn(4096)
    codec = get_codec("embedded")
    dec = codec.decode(codec.encode(x, CTX).truncated(64), CTX, x.numel())  # half a plane
    assert (dec.stats["present"] == 512).all()
    assert (dec.stats["planes"] == 0).all()
    assert dec.missing.all()  # half the rotated coordinates carry no bit: the span is missing
    assert nmse(dec.tensor, x) == pytest.approx(1 - 0.5 * (1 - distortion(1)), rel=0.05)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("coords", [1024, "mtu"])
def test_same_bytes_on_every_device(device, coords):
    """Scales, bodies and a trim's decoding agree bit for bit with the CPU's, also with a
    packet's coordinates not a power of two (as at MTU 1500: a scale divides by them)."""
    from trimlab import wire
    x = torch.randn(50000, generator=torch.Generator().manual_seed(2))
    for name in CODECS:
        codec = get_codec(name)
        ctx = CTX if coords == 1024 else CodecContext(seed=3, step=11, bucket=2, span=4096,
                                                      coords=wire.max_coords(codec, 1500))
        here = codec.encode(x, ctx)
        there = codec.encode(x.to(device), ctx)
        for field in ("scale", "body", "length"):
            assert torch.equal(getattr(here, field), getattr(there, field).cpu()), (name, field)
        cut = codec.body_bytes(ctx.coords) // 3
        assert torch.equal(codec.decode(here.truncated(cut), ctx, x.numel()).tensor,
                           codec.decode(there.truncated(cut), ctx, x.numel()).tensor.cpu()), name
        assert nmse(codec.decode(there, ctx, x.numel()).tensor.cpu(), x) < 1e-5


def _digest() -> str:
    """The input's digest, then each codec's (implementation and wire bytes). The input is
    exact integer arithmetic: torch's transcendental functions differ with the CPU
    capability it dispatches to (ATEN_CPU_CAPABILITY), which is not the codec's business."""
    from trimlab import wire
    i = torch.arange(20000, dtype=torch.int64)
    x = (((i * 2654435761) % 65536) - 32768).to(torch.float32) / 8192
    out = [hashlib.sha256(x.numpy().tobytes()).hexdigest()[:12]]
    for name in CODECS:
        codec, h = get_codec(name), hashlib.sha256()
        for p in wire.packetize(x, codec, ids=wire.PacketIds(job=1, step=5, rank=2), seed=7):
            h.update(p)
        out.append(f"{name}:{codec.implementation()}:{h.hexdigest()[:12]}")
    return " ".join(out)


def test_two_processes_produce_identical_bytes():
    code = "from tests.unit.test_codecs import _digest; print(_digest())"
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert runs == {_digest()}  # on failure: which codec, and whether the input already differed


def test_unknown_codec_and_parameters_are_clear_errors():
    with pytest.raises(CodecError, match="unknown; choose one of embedded"):
        get_codec("zip")
    with pytest.raises(CodecError, match="its parameters are: planes, unbiased"):
        get_codec("embedded", bits=3)
    with pytest.raises(CodecError, match="planes=0"):
        get_codec("embedded", planes=0)
    with pytest.raises(CodecError, match="multiple of 32"):
        get_codec("fp32").encode(torch.randn(100), CodecContext(coords=100))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(list(CODECS)), data=st.data())
def test_random_packets_never_crash_the_decoder(name, data):
    codec = get_codec(name)
    numel = data.draw(st.integers(1, 9000))
    n = data.draw(st.integers(0, 12))
    width = data.draw(st.integers(0, 4 * 1024))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31)))
    pk = Packets(span=torch.randint(-1, 4, (n,), generator=g),
                 index=torch.randint(-1, 6, (n,), generator=g),
                 coords=torch.randint(0, 3, (n,), generator=g) * 352 + 64,
                 scale=torch.randn(n, generator=g) * 1e30,
                 body=torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g),
                 length=torch.randint(-5, width + 5, (n,), generator=g))
    ctx = CodecContext(span=1024, coords=352)
    dec = codec.decode(pk, ctx, numel)
    assert dec.tensor.shape == (numel,) and dec.missing.shape == (numel,)


# -- float32's whole range -------------------------------------------------------------------

RMS = [1e-35, 1e-30, 1e-22, 1e-10, 1.0, 1e10, 1e18, 1e30, 1e35]


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("rms", RMS)
def test_every_magnitude_decodes_at_the_usual_nmse(name, params, rms):
    """A bucket's RMS anywhere from 1e-35 to 1e35 (and one coordinate far above the rest)
    round-trips as a unit-RMS bucket does, untrimmed and trimmed to 2 bits per coordinate."""
    codec = get_codec(name, **params)
    x = torch.randn(3 * CTX.span + 100, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    x[7] = 30.0  # a spike: the rotation must not overflow where one coordinate dominates
    scaled = (x * rms).to(torch.float32)
    unit = (x * 1.0).to(torch.float32)
    for kept in (None, 2 * CTX.coords // 8):
        got = []
        for v in (unit, scaled):
            pk = codec.encode(v, CTX)
            dec = codec.decode(pk if kept is None else pk.truncated(kept), CTX, v.numel())
            assert torch.isfinite(dec.tensor).all()
            got.append(float(((dec.tensor.double() - v.double()) ** 2).sum() / (v.double() ** 2).sum()))
        rel = 0.3 if name == "bf16" else 0.05  # bf16's rounding error depends on the mantissas scaling gives
        assert got[1] == pytest.approx(got[0], rel=rel, abs=1e-8), (kept, got)


def test_embedded_bytes_do_not_depend_on_the_power_of_two_a_bucket_is_scaled_by():
    """Spans are prescaled by a power of two: scaling a bucket by 2^k changes only the
    header scales (by exactly 2^k), never a body byte."""
    codec = get_codec("embedded")
    x = torch.randn(2 * CTX.span + 300, generator=torch.Generator().manual_seed(6))
    a, b = codec.encode(x, CTX), codec.encode(torch.ldexp(x, torch.tensor(-90)), CTX)
    assert torch.equal(a.body, b.body)
    assert torch.equal(torch.ldexp(a.scale, torch.tensor(-90)), b.scale)


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_and_inf_stay_non_finite(name, params, bad):
    """AMP's GradScaler skips a step whose gradients hold NaN or Inf: after the codec the
    bucket must still hold a non-finite value (rotated codecs spread it over its span)."""
    codec = get_codec(name, **params)
    x = torch.randn(2 * CTX.span, generator=torch.Generator().manual_seed(7))
    x[CTX.span + 5] = bad
    dec = codec.decode(codec.encode(x, CTX), CTX, x.numel())
    assert not torch.isfinite(dec.tensor[CTX.span:]).all()
    if codec.rotated:
        assert torch.isfinite(dec.tensor[:CTX.span]).all()  # the other span is untouched


@pytest.mark.parametrize("name,params", VARIANTS, ids=IDS)
def test_pack_unpack_round_trips_untrimmed_packets(name, params):
    codec = get_codec(name, **params)
    ctx = CodecContext(seed=1, step=2, bucket=3, span=4096, coords=480)
    for n in (1, 100, 4096 + 5, 20_000):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        pk = codec.encode(x, ctx)
        data = packing.pack(pk)
        assert len(data) == packing.packed_size(codec, n, ctx)
        back = packing.unpack(codec, data, ctx, n)
        assert torch.equal(codec.decode(back, ctx, n).tensor, codec.decode(pk, ctx, n).tensor)
    with pytest.raises(CodecError, match="need"):
        packing.unpack(codec, data[:-4], ctx, n)
    # the hook gathers compressed only where that saves bytes: embedded about halves them
    assert (packing.packed_size(codec, 20_000, ctx) < 4 * 20_000) == (name in ("embedded", "bf16"))
