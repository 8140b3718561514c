import json
import subprocess
import sys

from tests.rack.conftest import require_root


def test_bench_switch_quick_prints_its_json():
    require_root()
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "bench", "switch", "--json", "--quick"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert set(r["pps_median"]) == {"no_program", "program", "all_trimmed"}
    assert all(v > 1000 for v in r["pps_median"].values())
    per_round = sorted(p / n for p, n in zip(r["pps_all"]["program"], r["pps_all"]["no_program"]))
    assert r["forwarding_ratio"] == round(per_round[len(per_round) // 2], 3)  # median of 5
    assert len(r["pps_all"]["all_trimmed"]) == r["rounds"] == 5
    assert r["trimmed_packets_seen"] > 0  # the all_trimmed points really trimmed
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tlbsw" not in left


def test_bench_transport_quick_prints_its_json():
    """Our sender and our receive-and-decode path against blast.c on the same path, with and
    without every packet trimmed; the receiver really decoded (trimmed) gradient packets."""
    require_root()
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "bench", "transport", "--json", "--quick"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    for key in ("untrimmed", "all_trimmed"):
        m = r[key]
        assert m["blast_pps"] > 1000 and m["send_pps"] > 100 and m["receive_decode_pps"] > 100, m
        assert 0 < m["send_over_blast"] and 0 < m["receive_decode_over_blast"]
    assert set(r["targets"]) == {"send_over_blast_ge_0.8", "receive_decode_over_blast_ge_0.8"}
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tlbtr" not in left
