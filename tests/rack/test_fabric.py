"""The leaf–spine fabric on the virtual rack: hosts reach each other across leaves over
both address families, equal-cost multipath spreads flows over the spines, a packet
trimmed at a spine arrives cut to the trim size and is counted at that spine only, every
switch is provisioned through Ansible, and nothing is left behind."""

import json
import subprocess
import sys

import pytest
import yaml

from tests.rack.conftest import ROOT, Receiver, new_id, ns_python, require_root

CLI = [sys.executable, "-m", "trimlab.testbed.cli"]
SWITCHES = ("leaf1", "leaf2", "spine1", "spine2")


@pytest.fixture(scope="module")
def fabric(rack_factory):
    # w1, ps1 on leaf1; w2, tr1 on leaf2: everything between them crosses a spine. The
    # ideal platform: plain sockets see the trims (platforms: test_platforms.py)
    return rack_factory(workers=2, ps=1, traffic=1, rate="100mbit", leaves=2, spines=2, platform="ideal")


def addr(st, name, v6):
    h = next(x for x in st.hosts if x.name == name)
    return h.data_ipv6 if v6 else h.data_ipv4


def port_tx(st, sw, port):
    return st.vswitch(sw).counters()["ports"][port]["TX_PKTS"]


def test_layout_and_inventory(fabric):
    from trimlab.testbed import inventory
    hosts = {h.name: h for h in fabric.nic_hosts}
    assert {n: hosts[n].switch for n in hosts} == {"w1": "leaf1", "w2": "leaf2", "ps1": "leaf1", "tr1": "leaf2"}
    inv = inventory.load(fabric.inventory)
    by_name = {s.name: s for s in inv.switches}
    assert sorted(by_name) == sorted(f"tl{fabric.id}-{s}" for s in SWITCHES)
    leaf1 = by_name[f"tl{fabric.id}-leaf1"]
    assert leaf1.ports["Ethernet0"] == {"host": f"tl{fabric.id}-w1", "facing": "host", "speed_mbps": 100}
    assert leaf1.ports["Ethernet240"] == {"facing": "network", "peer": f"tl{fabric.id}-spine1:Ethernet0",
                                          "speed_mbps": 100}
    assert by_name[f"tl{fabric.id}-spine2"].ports["Ethernet4"]["peer"] == f"tl{fabric.id}-leaf2:Ethernet244"
    info = subprocess.run(CLI + ["rack", "status", "--id", fabric.id, "--json"], capture_output=True,
                          text=True, check=True, cwd=ROOT)
    assert yaml.safe_load(info.stdout)["switch_programs"] == {s: True for s in SWITCHES}


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_reachable_across_leaves_and_ecmp_spreads_flows_over_the_spines(fabric, v6):
    before = {s: port_tx(fabric, s, "Ethernet0") for s in ("spine1", "spine2")}  # spine -> leaf1
    rx = Receiver(fabric, "w1", v6=v6)
    ns_python(fabric, "w2", "udp_flows", f"dst={addr(fabric, 'w1', v6)}", "count=64").wait()
    got = rx.result()
    assert sorted(seq for _, seq, *_ in got) == list(range(64))
    per_spine = {s: port_tx(fabric, s, "Ethernet0") - before[s] for s in before}
    # 64 flows hashed on their 5-tuple: each spine carries some (all on one: p = 2^-63)
    assert all(n >= 8 for n in per_spine.values()), per_spine
    assert sum(per_spine.values()) >= 64
    rx = Receiver(fabric, "tr1", v6=v6)  # and back, ps -> the other leaf
    ns_python(fabric, "ps1", "udp_burst", f"dst={addr(fabric, 'tr1', v6)}", "count=20", "size=200",
              "tos=0").wait()
    assert len(rx.result()) == 20


def test_trimmed_at_a_spine_arrives_cut_and_is_counted_there_only(fabric):
    def trims():
        return {s: fabric.vswitch(s).counters()["switch"]["TRIM_PKTS"] for s in SWITCHES}
    inject = '{"TRIMLAB_INJECT": {"GLOBAL": {"probability": "1", "action": "trim", "seed": "0"}}}'
    path = fabric.dir / "inject.json"
    path.write_text(inject)
    try:
        for sp in ("spine1", "spine2"):  # through the CLI, as provisioning drives it
            subprocess.run(CLI + ["switch", "apply", str(path), "--id", fabric.id, "--switch", sp],
                           check=True, capture_output=True, cwd=ROOT)
        before = trims()
        rx = Receiver(fabric, "w1")
        ns_python(fabric, "w2", "udp_burst", f"dst={addr(fabric, 'w1', False)}", "count=50", "size=1000",
                  "tos=40").wait()  # DSCP 10: queue 1, which trims
        got = rx.result()
    finally:
        for sp in ("spine1", "spine2"):
            fabric.vswitch(sp).apply({"TRIMLAB_INJECT": {"GLOBAL": {"probability": "0"}}})
    size = fabric.vswitch("spine1").read().size
    assert len(got) == 50
    assert {n for _, _, n, _, _ in got} == {size - 14 - 20 - 8}  # cut at the trim size from Ethernet
    assert {tos >> 2 for *_, tos, _ in got} == {fabric.vswitch("spine1").read().dscp_value}
    delta = {s: n - before[s] for s, n in trims().items()}
    assert delta["leaf1"] == delta["leaf2"] == 0
    assert delta["spine1"] + delta["spine2"] == 50 and 0 in (delta["spine1"], delta["spine2"])  # one flow: one spine


def test_every_switch_is_provisioned_through_ansible(fabric):
    from trimlab.testbed import provision
    out = provision.run(fabric.inventory, profile="sonic-default")
    assert out.rc == 0 and not out.failures, out.failures
    assert {h for h, r in out.hosts.items() if r.changed} >= {f"tl{fabric.id}-{s}" for s in SWITCHES}
    sizes = {s: fabric.vswitch(s).read().size for s in SWITCHES}
    assert len(set(sizes.values())) == 1, sizes
    again = provision.run(fabric.inventory, profile="sonic-default")
    assert again.rc == 0 and not any(r.changed for r in again.hosts.values())


def test_asymmetric_profile_marks_trims_by_the_facing_of_the_port(fabric):
    """Provisioned with the asymmetric profile (from-tc): a packet trimmed leaving a spine
    (network-facing) arrives with DSCP 10, one trimmed leaving leaf1 towards its host
    with DSCP 20, so the receiver can tell where the congestion was."""
    from trimlab.testbed import provision
    out = provision.run(fabric.inventory, profile="asymmetric")
    assert out.rc == 0 and not out.failures, out.failures
    assert fabric.vswitch("leaf1").read().trim_dscp["Ethernet240"] == 10
    seen = {}
    for where in (("spine1", "spine2"), ("leaf1",)):
        for sw in where:
            fabric.vswitch(sw).apply({"TRIMLAB_INJECT": {"GLOBAL": {"probability": "1", "action": "trim"}}})
        try:
            rx = Receiver(fabric, "w1")
            ns_python(fabric, "w2", "udp_burst", f"dst={addr(fabric, 'w1', False)}", "count=10", "size=1000",
                      "tos=40").wait()
            got = rx.result()
        finally:
            for sw in where:
                fabric.vswitch(sw).apply({"TRIMLAB_INJECT": {"GLOBAL": {"probability": "0"}}})
        assert len(got) == 10 and {n for _, _, n, _, _ in got} == {528 - 14 - 20 - 8}
        seen[where[0][:5]] = {tos >> 2 for *_, tos, _ in got}
    assert seen == {"spine": {10}, "leaf1": {20}}


def test_bad_fabric_options_touch_nothing():
    require_root()
    from tests.rack.test_rack import leftovers
    rid = new_id()
    for args, msg in ((["--leaves", "2"], "leaves=2, spines=0"), (["--leaves", "9", "--spines", "1"], "leaves=9"),
                      (["--uplink-rate", "10mbit"], "uplink_rate='10mbit'"),
                      (["--leaves", "2", "--spines", "1", "--uplink-rate", "x"], "uplink_rate='x'")):
        out = subprocess.run(CLI + ["rack", "up", "--id", rid, *args], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 2 and msg in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert leftovers(rid) == {"namespaces": [], "links": [], "pins": [], "dir": False}


def test_down_leaves_nothing(rack_factory):
    from tests.rack.test_rack import assert_clean, sshd_pids
    from trimlab.testbed.vrack import rack
    st = rack_factory(workers=2, ps=0, traffic=0, leaves=2, spines=1, uplink_rate="50mbit")
    assert st.vswitch("spine1").read().speeds == {"Ethernet0": 50, "Ethernet4": 50}
    assert st.vswitch("leaf1").read().speeds == {"Ethernet0": 100, "Ethernet240": 50}
    pids = sshd_pids(st)
    rack.down(st)
    assert_clean(st.id, pids)


def test_fabric_sweep_locates_each_bottleneck_and_every_observer_agrees(tmp_path):
    """experiments/fabric.yaml as shipped (steps cut for time): at the ps's port, then at
    leaf2's uplink to the spine; every check agrees, trims are located at that port."""
    require_root()
    import pandas as pd

    from tests.rack.test_run import assert_nothing_left, manifest, trimlab_run
    spec = yaml.safe_load((ROOT / "experiments" / "fabric.yaml").read_text())
    spec["workload"]["steps"] = 20
    spec["capture"]["points"].append("switch")  # every port of every switch, too
    path = tmp_path / "fabric.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = trimlab_run(path, tmp_path / "runs", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sweep = next((tmp_path / "runs").iterdir())
    runs = sorted(d for d in sweep.iterdir() if (d / "manifest.json").exists())
    assert len(runs) == 2
    for run_dir, bottleneck in zip(runs, ("leaf1:Ethernet8", "leaf2:Ethernet240")):
        m = manifest(run_dir)
        assert m["status"] == "succeeded" and m["results"]["parameters_identical"]
        assert m["switches"] == ["leaf1", "leaf2", "spine1"]
        assert sorted(map(tuple, m["links"])) == [("leaf1:Ethernet240", "spine1:Ethernet0"),
                                                  ("leaf2:Ethernet240", "spine1:Ethernet4")]
        checks = json.loads((run_dir / "checks.json").read_text())
        # every observer of every packet agrees; the second point's paced workers are measured
        # too, and whether their host's kernel held the pace depends on its free cores (docs/load.md)
        assert not [c for c in checks["checks"] if c["status"] != "agree" and not c["check"].startswith("hook pacing")]
        names = {c["check"] for c in checks["checks"]}
        assert {"switch trims = captures (every hop)", "switch drops = never received (every hop)",
                "trims located"} <= names
        from trimlab.analysis.rundata import RunData
        trims = {p: c["TRIM_PKTS"] for p, c in RunData.open(run_dir).counters["ports"].items()}
        # congestion by construction (the spec's comment): a run without it says so here
        assert trims[bottleneck] > 0, f"no congestion at {bottleneck}: trims per port {trims}"
        assert max(trims, key=trims.get) == bottleneck, trims
        # each trimmed packet is located at the bottleneck, or is ambiguous where another
        # port of its path trimmed a few too (a burst at the ps's port can): never elsewhere
        table = pd.read_parquet(run_dir / "packets.parquet")
        where = table.loc[table["trimmed"], "trimmed_at"].value_counts()
        others = {p for p, n in trims.items() if n and p != bottleneck}
        assert set(where.index) <= {bottleneck, "ambiguous", *others}, where
        assert where.get(bottleneck, 0) + where.get("ambiguous", 0) >= 0.9 * where.sum(), where
        for d in ("leaf1", "leaf2", "spine1"):
            assert (run_dir / "switch" / d / "counters_after.json").exists()
            assert (run_dir / "switch" / d / "occupancy.csv").stat().st_size > 0
        assert 'id="fig-fabric"' in (run_dir / "report.html").read_text()
        pcaps = {p.name for p in (run_dir / "pcaps").glob("*.pcap")}
        assert {f"tl{m['rack_id']}-leaf2-Ethernet240.pcap", f"tl{m['rack_id']}-spine1-Ethernet0.pcap",
                f"tl{m['rack_id']}-leaf1-Ethernet8.pcap"} <= pcaps, pcaps  # NAME-PORT.pcap per switch port
        assert_nothing_left(m["rack_id"], run_dir.name)


def test_down_all_after_sigkill_mid_up_of_a_fabric():
    """Killed once the first leaf's program is pinned (namespaces, uplinks, pins half
    built), with the state file gone too: `rack down --all` still leaves nothing."""
    require_root()
    import shutil
    import signal
    import time
    from pathlib import Path

    from tests.rack.test_rack import assert_clean, leftovers
    from trimlab.testbed.vrack import rack
    rid = new_id()
    proc = subprocess.Popen(CLI + ["rack", "up", "--id", rid, "--workers", "4", "--leaves", "2", "--spines", "2"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not Path(f"/sys/fs/bpf/tl{rid}/leaf1/prog").exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert leftovers(rid)["namespaces"] and leftovers(rid)["pins"]  # a half-built fabric
        shutil.rmtree(rack.racks_dir() / rid)
        out = subprocess.run(CLI + ["rack", "down", "--all"], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        assert_clean(rid)
    finally:
        if proc.poll() is None:
            proc.kill()
        try:
            rack.down(rack.RackState.load(rid))
        except rack.RackError:
            pass
