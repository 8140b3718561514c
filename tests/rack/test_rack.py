"""Virtual rack lifecycle: up, status, SSH with pinned keys, inventory, two racks side by
side, down after a normal run and after the orchestrator was SIGKILLed mid-up."""

import csv
import json
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.rack.conftest import ROOT, new_id, ns_python, require_root

CLI = [sys.executable, "-m", "trimlab.testbed.cli"]


def leftovers(rack_id: str) -> dict:
    prefix = f"tl{rack_id}-"
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    from trimlab.testbed.vrack import rack
    return {
        "namespaces": [n for n in ns if n.startswith(prefix)],
        "links": [line for line in links.splitlines() if prefix in line],
        "pins": [p.name for p in Path("/sys/fs/bpf").glob(f"tl{rack_id}")],
        "dir": (rack.racks_dir() / rack_id).exists(),
    }


def assert_clean(rack_id: str, pids=()):
    assert leftovers(rack_id) == {"namespaces": [], "links": [], "pins": [], "dir": False}
    from trimlab.testbed.vrack.rack import alive
    deadline = time.monotonic() + 5
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p for p in pids if alive(p)] == []


def ssh(st, host, *cmd, known_hosts=None):
    h = next(x for x in st.hosts if x.name == host)
    return subprocess.run(["ssh", "-i", str(st.dir / "keys" / "id_ed25519"), "-o", "BatchMode=yes",
                           "-o", f"UserKnownHostsFile={known_hosts or st.dir / 'known_hosts'}",
                           "-o", "StrictHostKeyChecking=yes", "-o", "ConnectTimeout=5",
                           f"root@{h.mgmt_ip}", shlex.join(cmd)], capture_output=True, text=True, timeout=30)


def sshd_pids(st):
    return [int(p.read_text()) for p in (st.dir / "run").glob("sshd_*.pid")]


@pytest.fixture
def rack_id():
    require_root()
    rid = new_id()
    yield rid
    from trimlab.testbed.vrack import rack
    try:
        rack.down(rack.RackState.load(rid))
    except rack.RackError:
        pass


def test_up_status_ssh_inventory_down(rack_id, tmp_path):
    out = subprocess.run(CLI + ["rack", "up", "--id", rack_id, "--workers", "3"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    inv_path = Path(out.stdout.strip().splitlines()[-1])
    from trimlab.testbed.vrack import rack
    st = rack.RackState.load(rack_id)
    assert inv_path == st.dir / "inventory.yml"

    status = json.loads(subprocess.run(CLI + ["rack", "status", "--id", rack_id, "--json"],
                                       capture_output=True, text=True, check=True).stdout)
    assert status["switch_program"]
    assert [h["name"] for h in status["hosts"]] == ["sw", "w1", "w2", "w3", "ps1", "tr1"]
    assert all(h["namespace"] and h["sshd"] for h in status["hosts"])

    inv = yaml.safe_load(inv_path.read_text())["all"]
    (sw_name, sw), = inv["children"]["trim_switches"]["hosts"].items()
    assert sw["trim_switch_os"] == "vswitch" and len(sw["ports"]) == 5
    hosts = inv["children"]["nic_hosts"]["hosts"]
    assert {h["role"] for h in hosts.values()} == {"worker", "ps", "traffic"}

    for h in st.hosts:  # every host answers over SSH with its pinned host key
        r = ssh(st, h.name, "ip", "-br", "addr")
        assert r.returncode == 0, r.stderr
        if h.data_ipv4:
            assert h.data_ipv4 in r.stdout and h.data_ipv6 in r.stdout
    wrong = tmp_path / "known_hosts"  # a host whose key changed is refused
    lines = (st.dir / "known_hosts").read_text().splitlines()
    wrong.write_text("\n".join([lines[1].split()[0] + " " + " ".join(lines[2].split()[1:])] + lines[2:]) + "\n")
    r = ssh(st, "w1", "true", known_hosts=wrong)
    assert r.returncode != 0 and "host key" in r.stderr.lower()

    # data plane, IPv4 and IPv6, across the switch: a closed port answers with a reset
    ps = next(h for h in st.hosts if h.name == "ps1")
    for dst in (ps.data_ipv4, ps.data_ipv6):
        r = ssh(st, "w2", sys.executable, "-c", f"import socket; socket.create_connection(('{dst}', 9), 3)")
        assert "ConnectionRefusedError" in r.stderr, r.stderr

    pids = sshd_pids(st)
    assert len(pids) == 6 and all(Path(f"/proc/{p}").exists() for p in pids)
    down = subprocess.run(CLI + ["rack", "down", "--id", rack_id], capture_output=True, text=True)
    assert down.returncode == 0, down.stderr
    assert_clean(rack_id, pids)


def test_two_racks_coexist(rack_id):
    from trimlab.testbed.vrack import rack
    other = new_id()
    a = rack.up(rack.plan(rack_id, 1, 1, 0, "100mbit", 1500, 0))
    try:
        b = rack.up(rack.plan(other, 1, 1, 0, "100mbit", 1500, 0))
        assert a.slot != b.slot
        for st in (a, b):
            s = rack.status(st)
            assert s["switch_program"] and all(h["sshd"] for h in s["hosts"])
            assert st.vswitch().counters()["switch"]["DROP_PKTS"] == 0
        rack.down(b)
        assert_clean(other)
        s = rack.status(a)
        assert s["switch_program"] and all(h["sshd"] for h in s["hosts"])
    finally:
        if (rack.racks_dir() / other).exists():
            rack.down(rack.RackState.load(other))


def test_sampler_records_occupancy_every_10ms(rack_id, tmp_path):
    from trimlab.testbed.vrack import rack
    st = rack.up(rack.plan(rack_id, 2, 1, 0, "50mbit", 1500, 0))
    out = tmp_path / "occupancy.csv"
    sampler = subprocess.Popen(CLI + ["switch", "sample", "--id", rack_id, "--out", str(out)],
                               cwd=ROOT, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (out.exists() and len(out.read_text().splitlines()) > 1):  # sampling has begun
        assert time.monotonic() < deadline and sampler.poll() is None
        time.sleep(0.02)
    ps = next(h for h in st.hosts if h.name == "ps1")
    senders = [ns_python(st, w, "udp_burst", f"dst={ps.data_ipv4}", "count=800", "size=1400", f"tos={10 << 2}")
               for w in ("w1", "w2")]
    for s in senders:
        s.communicate(timeout=60)
    time.sleep(0.6)
    sampler.send_signal(signal.SIGTERM)
    _, err = sampler.communicate(timeout=10)
    assert sampler.returncode == 0, err
    rows = list(csv.DictReader(out.open()))
    times = sorted({float(r["time_s"]) for r in rows})
    assert len(times) > 60  # at least the 0.6 s after the burst, at 10 ms
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert gaps[len(gaps) // 2] == pytest.approx(0.01, abs=0.004)  # median interval
    ps_q1 = [r for r in rows if r["port"] == ps.port and r["queue"] == "1"]
    assert max(int(r["OCCUPANCY"]) for r in ps_q1) > 10000  # the incast filled the queue
    tx = [int(r["TX_PKTS"]) for r in ps_q1]
    assert tx == sorted(tx) and tx[-1] > 0


def test_down_all_after_sigkill_mid_up(rack_id):
    from trimlab.testbed.vrack import rack
    proc = subprocess.Popen(CLI + ["rack", "up", "--id", rack_id, "--workers", "8"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while not any(n.startswith(f"tl{rack_id}-w4") for n in leftovers(rack_id)["namespaces"]):
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert leftovers(rack_id)["namespaces"]  # it left a half-built rack behind
    import shutil
    shutil.rmtree(rack.racks_dir() / rack_id)  # and, worst case, no state file
    out = subprocess.run(CLI + ["rack", "down", "--all"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert_clean(rack_id)
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [n for n in ns.split() if n.startswith("tl")]


def test_bad_options_touch_nothing(rack_id):
    for args, msg in ((["--workers", "0"], "workers=0"), (["--rate", "fast"], "rate='fast'"),
                      (["--mtu", "100"], "mtu=100"), (["--id", "BAD_ID"], "id='BAD_ID'")):
        out = subprocess.run(CLI + ["rack", "up", "--id", rack_id, *args], capture_output=True, text=True)
        assert out.returncode == 2 and msg in out.stderr and "Traceback" not in out.stderr
        assert leftovers(rack_id) == {"namespaces": [], "links": [], "pins": [], "dir": False}
