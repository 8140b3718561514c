"""Switch platforms and the hosts' receive repair, with real trimlab datagrams through a
virtual rack: each platform model's trimmed packets reach a plain UDP socket with the
repair and are lost without it; the TH5 model's one size; the Ultra Ethernet model never
trims twice across a fabric; the repair program, run by the kernel on crafted frames,
repairs exactly the trimmed trimlab datagrams and leaves everything else byte-identical."""

import json
import subprocess
import tempfile
from pathlib import Path

import pytest
import torch
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from tests.rack.conftest import Receiver, host
from tests.rack.test_switch import fragment, mac, send_frames
from trimlab import wire
from trimlab.agents import repair
from trimlab.codec import get_codec
from trimlab.config import GRADIENT_PORT
from trimlab.errors import SpecError
from trimlab import platforms

TOS = (10 << 2) | 1  # DSCP 10 (queue 1, trimmable), ECT(1)


def payloads(coords=480):
    """A span's trimlab gradient datagrams (whole, as a worker sends them)."""
    codec = get_codec("embedded", planes=8)
    g = torch.randn(4096, generator=torch.Generator().manual_seed(5))
    return wire.packetize(g, codec, coords=coords, ids=wire.PacketIds(1, 5, 0, 0))


N = len(payloads())

def gradient_frames(st, src, dst, v6, tos=TOS):
    a, b = host(st, src), host(st, dst)
    l3 = IPv6(src=a.data_ipv6, dst=b.data_ipv6, tc=tos) if v6 else IP(src=a.data_ipv4, dst=b.data_ipv4, tos=tos)
    return [Ether(src=mac(st, src), dst=mac(st, dst)) / l3 / UDP(sport=40000, dport=GRADIENT_PORT) / Raw(p)
            for p in payloads()]


def emulate(st, name, size=None):
    """The rack's switch emulates platform `name`, trimming queue 1 at injection p = 1."""
    from trimlab.testbed.vrack import vswitch
    plat = platforms.get(name)
    sw = st.vswitch()
    sw.write(vswitch.default_config(st.ports, 100, platform=name))
    sw.apply(fragment(st, size=size or plat.trim_size.fixed or max(128, plat.trim_size.min), p=1.0))
    return plat


@pytest.fixture(scope="module")
def rack2(rack_factory):
    return rack_factory(workers=1, ps=1, rate="100mbit")


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("name", list(platforms.catalog()))
def test_trimmed_gradients_reach_the_socket_with_the_repair_and_are_lost_without(rack2, name, v6):
    plat = emulate(rack2, name)
    size = plat.trim_size.fixed or max(128, plat.trim_size.min)
    ps = host(rack2, "ps1")
    kept = size - 14 - (40 if v6 else 20) - 8
    before = repair.status("eth1", ps.ns)["counters"]
    rx = Receiver(rack2, "ps1", v6=v6, port=GRADIENT_PORT)
    send_frames(rack2, "w1", gradient_frames(rack2, "w1", "ps1", v6))
    got = rx.result()
    after = repair.status("eth1", ps.ns)["counters"]
    assert [n for *_, n, _, _ in got] == [kept] * N, (name, got)
    assert after["repaired"] - before["repaired"] == N and after["refused"] == before["refused"]
    repair.remove("eth1", ps.ns)
    try:
        rx = Receiver(rack2, "ps1", v6=v6, port=GRADIENT_PORT)
        send_frames(rack2, "w1", gradient_frames(rack2, "w1", "ps1", v6))
        lost = rx.result()
    finally:
        repair.install("eth1", ns=ps.ns)
    # a platform that leaves anything stale loses every trim at a plain Linux host
    assert len(lost) == (0 if plat.needs_repair else N), (name, plat.stale)


def test_th5_refuses_a_128_byte_profile_and_trims_to_206(rack2):
    from trimlab.spec import TrimProfile
    from trimlab.testbed.targets import get_target

    emulate(rack2, "sonic-th5")
    with pytest.raises(SpecError, match="SWITCH_TRIMMING|GLOBAL.size: 128; platform sonic-th5 trims to 206 bytes only"):
        rack2.vswitch().apply(fragment(rack2, size=128, p=1.0))
    t = get_target("vswitch")
    t.configure("sw", {"trim_switch_platform": "sonic-th5"})
    prof = TrimProfile(name="p", size=128, dscp=48, queue=7, eligible_queues=[1])
    with pytest.raises(SpecError, match="profile p: field size=128: platform sonic-th5 allows 206 bytes only"):
        t.render(prof, list(t.default_ports))
    assert rack2.vswitch().read().size == 206  # the refused fragment changed nothing
    rx = Receiver(rack2, "ps1", port=GRADIENT_PORT)
    send_frames(rack2, "w1", gradient_frames(rack2, "w1", "ps1", False))
    assert {n for *_, n, _, _ in rx.result()} == {206 - 14 - 20 - 8}


def test_uec_never_trims_a_packet_twice_across_two_hops(rack_factory, tmp_path):
    """leaf2 → spine1 → leaf1, every hop trimming queue 1 and queue 6 (where trimmed
    packets' DSCP 48 lands) at injection p = 1: the ideal switch trims at every hop, the
    Ultra Ethernet model only at the first, and marks the last hop's trims apart."""
    from trimlab.testbed import inventory
    from trimlab.testbed.provision import render_profiles

    st = rack_factory(workers=2, ps=1, rate="100mbit", leaves=2, spines=1)
    prof = tmp_path / "uec.yml"
    prof.write_text("name: uec\nsize: 256\ndscp: from-tc\ntrim_tc: 6\nport_dscp: {network: 48, host: 49}\n"
                    "queue: 7\neligible_queues: [1, 6]\ninjection: {probability: 1.0}\n")
    w2 = host(st, "w2")
    assert w2.switch == "leaf2" and host(st, "ps1").switch == "leaf1"
    trims = {}
    for name in ("ideal", "uec-1.0"):
        from trimlab.testbed.vrack import vswitch
        for sw in st.switches:
            st.vswitch(sw.name).write(vswitch.default_config(list(st.port_rates(sw.name)), 100, platform=name))
        st.platforms = {sw.name: name for sw in st.switches}
        inv_path = st.dir / f"inventory-{name}.yml"
        inv_path.write_text(Path(st.inventory).read_text().replace("trim_switch_platform: sonic",
                                                                   f"trim_switch_platform: {name}"))
        out = tmp_path / name
        out.mkdir()
        render_profiles(inventory.load(inv_path), str(prof), out)
        before = {sw.name: st.vswitch(sw.name).counters()["switch"]["TRIM_PKTS"] for sw in st.switches}
        for sw in st.switches:
            st.vswitch(sw.name).apply(json.loads((out / f"{sw.ns}.json").read_text()))
        rx = Receiver(st, "ps1", port=GRADIENT_PORT)
        a, b = w2, host(st, "ps1")  # routed: the first hop is leaf2's gateway (its bridge)
        leaf2 = next(h for h in st.switches if h.name == "leaf2")
        gw_mac = json.loads(subprocess.run(["ip", "netns", "exec", leaf2.ns, "ip", "-j", "link", "show", "br0"],
                                           capture_output=True, text=True, check=True).stdout)[0]["address"]
        frames = [Ether(src=mac(st, "w2"), dst=gw_mac) / IP(src=a.data_ipv4, dst=b.data_ipv4, tos=TOS, ttl=64)
                  / UDP(sport=40000, dport=GRADIENT_PORT) / Raw(p) for p in payloads()]
        send_frames(st, "w2", frames)
        got = rx.result()
        trims[name] = {sw.name: st.vswitch(sw.name).counters()["switch"]["TRIM_PKTS"] - before[sw.name]
                       for sw in st.switches}
        assert [n for *_, n, _, _ in got] == [256 - 14 - 20 - 8] * N, (name, got)
        if name == "uec-1.0":  # trimmed on leaf2's uplink (network: 48), never again
            assert {tos >> 2 for *_, tos, _ in got} == {48}
    # (the ideal fabric may trim a stray control packet of the hosts' own too: at least N)
    assert all(trims["ideal"][sw] >= N for sw in ("leaf1", "leaf2", "spine1")), trims
    assert trims["uec-1.0"] == {"leaf1": 0, "leaf2": N, "spine1": 0}


def _run_repair(prog_id: int, frame: bytes) -> bytes:
    """The repair program run once by the kernel (BPF_PROG_TEST_RUN) on one frame."""
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "in", Path(d) / "out"
        src.write_bytes(frame)
        subprocess.run(["bpftool", "prog", "run", "id", str(prog_id), "data_in", str(src), "data_out", str(dst),
                        "data_size_out", "16384"], check=True, capture_output=True)
        return dst.read_bytes()


def _valid(frame: bytes) -> bool:
    """Lengths match the frame and every checksum is what scapy computes afresh."""
    p = Ether(frame)
    ip = p.getlayer(IP) or p.getlayer(IPv6)
    fresh = Ether(frame)
    for layer in (IP, UDP):
        if layer in fresh:
            del fresh[layer].chksum
            del fresh[layer].len
    if IPv6 in fresh:
        del fresh[IPv6].plen
    rebuilt = Ether(bytes(fresh))
    return bytes(rebuilt) == frame and ip is not None


def test_the_repair_fixes_exactly_trimmed_trimlab_datagrams(rack2):
    ps = host(rack2, "ps1")
    prog = repair.status("eth1", ps.ns)["prog_id"]
    pay = payloads()[0]
    eth = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")
    v4 = IP(src="198.19.0.10", dst="198.19.0.11", tos=TOS)
    v6 = IPv6(src="fd00:7472::a", dst="fd00:7472::b", tc=TOS)

    def stale_trim(l3, size=128, dscp=48):
        whole = bytearray(bytes(eth / l3 / UDP(sport=1, dport=GRADIENT_PORT) / Raw(pay)))
        if IP in l3:
            whole[15] = (dscp << 2) | (whole[15] & 3)  # remarked, checksum left as it was
        else:
            whole[14] = 0x60 | (dscp >> 2)
            whole[15] = ((dscp & 3) << 6) | (whole[15] & 0x3F)
        return bytes(whole[:size])

    untouched = {
        "tcp": bytes(eth / v4 / TCP(sport=5, dport=GRADIENT_PORT, flags="PA") / Raw(pay[:300])),
        "foreign udp": bytes(eth / v4 / UDP(sport=5, dport=9) / Raw(pay))[:128],
        "no trimlab magic": bytes(eth / v4 / UDP(sport=5, dport=GRADIENT_PORT) / Raw(bytes(len(pay))))[:128],
        "whole trimlab datagram": bytes(eth / v4 / UDP(sport=1, dport=GRADIENT_PORT) / Raw(pay)),
        "ipv6 whole": bytes(eth / v6 / UDP(sport=1, dport=GRADIENT_PORT) / Raw(pay)),
    }
    for what, frame in untouched.items():
        assert _run_repair(prog, frame) == frame, what
    for what, frame in {"ipv4 stale": stale_trim(v4), "ipv6 stale": stale_trim(v6),
                        "ipv4 th5 size": stale_trim(v4, 206), "ipv4 not remarked": stale_trim(v4, 300, 10)}.items():
        assert not _valid(frame)
        out = _run_repair(prog, frame)
        assert len(out) == len(frame) and _valid(out), what
        assert out[14 + (40 if "ipv6" in what else 20) + 8:] == frame[14 + (40 if "ipv6" in what else 20) + 8:]
    # a trimmed packet whose header is damaged beyond a DSCP remark is never made valid
    bad = bytearray(stale_trim(v4))
    bad[22] ^= 0x01  # TTL
    assert _run_repair(prog, bytes(bad)) == bytes(bad)
    bad = bytearray(stale_trim(v4))
    bad[38:40] = (1000).to_bytes(2, "big")  # a UDP length neither the frame's nor as sent
    assert _run_repair(prog, bytes(bad)) == bytes(bad)
    ideal = Ether(stale_trim(v4))  # trimmed and rewritten already (the ideal switch): unchanged
    del ideal[IP].len, ideal[IP].chksum, ideal[UDP].len, ideal[UDP].chksum
    ideal = bytes(Ether(bytes(ideal)))
    assert _run_repair(prog, ideal) == ideal


def test_a_run_refuses_a_receiver_without_the_repair_behind_a_stale_platform(rack_factory, tmp_path):
    """A lab-shaped run (`rack.inventory`) on a rack whose hosts have no repair, behind the
    default platform: provisioning keeps them as they are (nic_host_repair: false), the
    run stops before any agent starts and says which host, which switch, how to fix."""
    from tests.rack.test_run import SPEC, manifest, trimlab_run

    st = rack_factory(workers=2, ps=1, traffic=0, rate="100mbit", repair_hosts=False)
    assert repair.status("eth1", host(st, "ps1").ns) is None
    spec = json.loads(json.dumps(SPEC)) | {"name": "norepair", "rack": {"inventory": str(st.inventory)}}
    path = tmp_path / "norepair.yaml"
    path.write_text(json.dumps(spec))
    out = trimlab_run(path, tmp_path / "runs")
    assert out.returncode != 0
    run_dir = next(d for d in (tmp_path / "runs").rglob("manifest.json")).parent
    m = manifest(run_dir)
    assert m["status"] == "failed" and m["ended_in"] == "prepare", m
    assert (f"host tl{st.id}-ps1: no receive repair on eth1, and switch tl{st.id}-sw (sonic) leaves ip_length, "
            "ipv4_checksum, udp_length, l4_checksum of trimmed packets stale, so its kernel would drop every "
            "trim; provision with nic_host_repair: true") in m["reason"]
    assert not (run_dir / "agents").exists() or not any((run_dir / "agents").rglob("packets.csv"))
