import json
import subprocess
import sys

import pytest

from trimlab.errors import SpecError
from trimlab.spec import TrimPlan, validated


def plan(**kw):
    return validated(TrimPlan, kw).figures()


def test_sonic_default_trim_of_an_embedded_packet():
    f = plan(trim_size=128, mtu=1500)
    assert f["coords"] == 704  # (1500 - 20 - 8 - 24) bytes at 2 bytes per coordinate, /32
    assert f["frame_bytes"] == 14 + 20 + 8 + 24 + 1408
    assert f["body_bytes_kept"] == 128 - 66 == 62
    assert f["bits_per_coord_kept"] == pytest.approx(62 * 8 / 704)
    # 62 bytes = 496 coordinates with 1 bit, 208 with none.
    assert f["expected_nmse_trimmed"] == pytest.approx((496 * 0.3634 + 208) / 704, rel=1e-3)
    assert f["expected_nmse_untrimmed"] < 1e-9 and f["trimmed"]
    # rotated: 208 coordinates without a bit leave the whole span missing; 480 would not
    assert f["rotated"] and not f["every_coord_kept"] and f["max_coords_every_coord_kept"] == 480
    ok = plan(trim_size=128, mtu=1500, coords=480)
    assert ok["every_coord_kept"] and ok["body_bytes_kept"] == 62


def test_cli_warns_when_a_trim_acts_as_a_drop():
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "plan", "--trim-size", "128"],
                         capture_output=True, text=True, check=True).stdout
    assert "warning: a trim leaves 208 coordinates without a bit" in " ".join(out.split())
    assert "Use --coords 480 or fewer" in " ".join(out.split())
    fine = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "plan", "--trim-size", "128", "--coords", "352"],
                          capture_output=True, text=True, check=True).stdout
    assert "warning" not in fine


def test_ipv6_keeps_twenty_bytes_less():
    f = plan(trim_size=128, mtu=1500, codec="sign_tail", ipv6=True)
    assert f["body_bytes_kept"] == 42 and f["coords"] == 352
    assert f["expected_nmse_trimmed"] == pytest.approx(0.3634 * 336 / 352 + 16 / 352, rel=1e-3)


def test_jumbo_fp32_and_untrimmed_case():
    f = plan(trim_size=1024, mtu=9000, codec="fp32")
    assert f["coords"] == 2208 and f["body_bytes_kept"] == 958
    assert f["expected_nmse_trimmed"] == pytest.approx(1 - 239 / 2208)
    small = plan(trim_size=1024, mtu=1500, coords=64)
    assert not small["trimmed"] and small["body_bytes_kept"] == small["body_bytes_sent"]


@pytest.mark.parametrize("kw,msg", [
    (dict(trim_size=65), "trim_size=65: cannot keep the 24-byte trimlab header over IPv4/UDP: use at least 66"),
    (dict(trim_size=85, ipv6=True), "use at least 86"),
    (dict(trim_size=128, coords=100), "coords=100: B must be a positive multiple of 32"),
    (dict(trim_size=128, coords=736), "coords=736: does not fit mtu=1500 with codec embedded: at most 704"),
    (dict(trim_size=128, mtu=1000, ipv6=True), "mtu=1000: IPv6 needs an MTU of at least 1280"),
    (dict(trim_size=128, codec="gzip"), "codec: must be one of"),
    (dict(trim_size=128, mtu=100000), "mtu: Input should be less than or equal to 9216"),
    (dict(trim_size=128, colour="red"), "colour: Extra inputs are not permitted"),
    (dict(trim_size=128, span=1000), "span=1000: use a power of two, at least 32"),
])
def test_bad_plans_name_the_field(kw, msg):
    with pytest.raises(SpecError, match=msg.replace("(", r"\(")):
        validated(TrimPlan, kw)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", *args], capture_output=True, text=True)


def test_plan_cli_json_and_refusal():
    ok = _cli("plan", "--trim-size", "256", "--mtu", "9000", "--codec", "embedded", "--json")
    assert ok.returncode == 0, ok.stderr
    f = json.loads(ok.stdout)
    # jumbo frames: embedded fits 4448 coordinates, a packet carries at most one span (as a run's)
    assert f["body_bytes_kept"] == 190 and f["coords"] == 4096
    wide = json.loads(_cli("plan", "--trim-size", "256", "--mtu", "9000", "--span", "8192", "--json").stdout)
    assert wide["coords"] == 4448
    bad = _cli("plan", "--trim-size", "60")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: trim_size=60: cannot keep the 24-byte trimlab header over IPv4/UDP: use at least 66"
    assert "Traceback" not in bad.stderr
    text = _cli("plan", "--trim-size", "128")
    assert "0.705 bits/coord" in text.stdout and "expected NMSE 0.551" in text.stdout
