import json
import subprocess
import sys

from trimlab.codec import CODECS


def test_bench_codec_quick_prints_its_json():
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "bench", "codec", "--json", "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bench"] == "codec" and result["numel_roundtrip"] == 1 << 22
    rows = result["nmse"]
    assert {r["codec"] for r in rows} == set(CODECS)
    assert len(rows) == len(CODECS) * (8 + 8)  # 8 bit widths, 4 trim sizes × 2 MTUs
    for r in rows:
        for key in ("gaussian", "student_t3", "lognormal_s2", "theory"):
            assert 0 <= r[key] <= 1.0 + 1e-6, (r, key)
    assert result["targets"]["embedded_gaussian_le_1.1_Dk"]
    assert result["targets"]["embedded_1bit_heavy_tailed_le_0.40"]
    for name in CODECS:
        r = result["roundtrip"][name]
        assert r["clone_ms"] > 0 and r["encode_ms"] > 0 and r["decode_ms"] > 0
        ratio = (r["encode_ms"] + r["decode_ms"]) / r["clone_ms"]
        assert abs(r["roundtrip_over_clone"] - ratio) <= 0.01 * ratio + 0.01
    for name in ("embedded", "sign_tail"):  # the native kernels are built by make setup's gcc
        r = result["roundtrip"][name]
        assert r["implementation"] == "native" and r["native_bytes_equal_torch"]
        assert r["torch_reference"]["encode_ms"] > 0 and r["speedup_over_torch"] > 0
    assert result["targets"]["native_bytes_equal_torch"]
    bare = result["sign_tail_without_rotation"]  # the packing's share of sign_tail's ratio
    assert bare["implementation"] == "native" and not bare["rotate"] and bare["roundtrip_over_clone"] > 0
    assert bare["butterflies_over_clone"] == round(
        result["roundtrip"]["sign_tail"]["roundtrip_over_clone"] - bare["roundtrip_over_clone"], 2)


def test_bench_pcap_quick_compares_with_dpkt_and_tshark():
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "bench", "pcap", "--json", "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bench"] == "pcap" and result["packets"] == 50_000
    for base in ("dpkt", "tshark"):  # both baselines are installed by make setup
        r = result[base]
        assert r["packets_per_s"] > 0
        assert abs(r["ratio"] - result["packets_per_s"] / r["packets_per_s"]) <= 0.02 * r["ratio"] + 0.02
