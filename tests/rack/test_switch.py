"""The eBPF trimming switch, after SONiC's packet-trimming test plan, with real traffic
through a virtual rack: scapy-built frames, sockets, tcpdump captures, switch counters.
The switch here emulates the `ideal` platform (every length and checksum rewritten), so
that plain sockets see the trims; what real platforms do is test_platforms.py's."""

import json
import subprocess
import sys

import pytest
from scapy.layers.inet import IP, TCP, UDP
from scapy.layers.inet6 import IPv6
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from tests.rack.conftest import Capture, Receiver, host, ns_python
from trimlab.errors import SpecError

TOS = (10 << 2) | 1  # DSCP 10 (AF11: queue 1, trimmable) with ECN ECT(1)


def fragment(ports, size=128, action="trim", budget=65536, trim_budget=65536, p=0.0, inject="trim",
             dscp_value=48, queue_index=7, seed=0, inject_queues=""):
    """Queue 1 (DSCP 8-15) with `action` and `budget` on every port, trimmed packets on
    `queue_index` with `trim_budget`, injection p."""
    ports = ",".join(ports.ports if hasattr(ports, "ports") else ports)
    return {
        "SWITCH_TRIMMING": {"GLOBAL": {"size": str(size), "dscp_value": str(dscp_value),
                                       "queue_index": str(queue_index)}},
        "BUFFER_PROFILE": {"q_grad": {"static_th": str(budget), "packet_discard_action": action},
                           "q_trimmed": {"static_th": str(trim_budget), "packet_discard_action": "drop"}},
        "BUFFER_QUEUE": {f"{ports}|1": {"profile": "q_grad"}, f"{ports}|{queue_index}": {"profile": "q_trimmed"}},
        "TRIMLAB_INJECT": {"GLOBAL": {"probability": str(p), "action": inject, "seed": str(seed),
                                      **({"queues": inject_queues} if inject_queues else {})}},
    }


@pytest.fixture(scope="module")
def rack4(rack_factory):
    return rack_factory(workers=4, ps=1, rate="100mbit", platform="ideal")


@pytest.fixture
def sw(rack4):
    from trimlab.testbed.vrack import vswitch
    s = rack4.vswitch()
    s.write(vswitch.default_config(rack4.ports, 100, platform="ideal"))
    yield s
    s.write(vswitch.default_config(rack4.ports, 100, platform="ideal"))


PS_PORT = "Ethernet16"  # rack4: w1..w4 on Ethernet0..12, ps1 on Ethernet16


def mac(st, name):
    out = subprocess.run(["ip", "netns", "exec", host(st, name).ns, "ip", "-j", "link", "show", "eth1"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)[0]["address"]


def frames(st, src, dst, l4, v6, payload, tos=TOS, count=1):
    a, b = host(st, src), host(st, dst)
    l3 = (IPv6(src=a.data_ipv6, dst=b.data_ipv6, tc=tos) if v6 else IP(src=a.data_ipv4, dst=b.data_ipv4, tos=tos))
    l4h = UDP(sport=1234, dport=9) if l4 == "udp" else TCP(sport=1234, dport=9, flags="PA", seq=7)
    return [Ether(src=mac(st, src), dst=mac(st, dst)) / l3 / l4h / Raw(bytes([i % 251]) * payload)
            for i in range(count)]


def send_frames(st, src, pkts):
    p = ns_python(st, src, "send", "hexframes=" + ",".join(bytes(f).hex() for f in pkts), "gap=0.001")
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err


def checksums_ok(frame) -> bool:
    fresh = frame.copy()
    for layer in (IP, UDP, TCP):
        if layer in fresh:
            del fresh[layer].chksum
    rebuilt = Ether(bytes(fresh))
    return all(rebuilt[layer].chksum == frame[layer].chksum for layer in (IP, UDP, TCP) if layer in frame)


def delta(before, after):
    def sub(a, b):
        return {k: sub(a[k], b[k]) for k in a} if isinstance(a, dict) else (
            [sub(x, y) for x, y in zip(a, b)] if isinstance(a, list) else a - b)
    return sub(after, before)


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
@pytest.mark.parametrize("l4", ["udp", "tcp"])
def test_trimmed_size_remark_and_checksums_are_exact(rack4, sw, v6, l4):
    filt = f"{l4} and dst port 9"
    for size in (62, 128, 256, 528, 1024):
        sw.apply(fragment(rack4, size=size, p=1.0))
        cap = Capture(rack4, "ps1", filt)
        send_frames(rack4, "w1", frames(rack4, "w1", "ps1", l4, v6, 1200, count=3))
        got = cap.stop()
        assert len(got) == 3, (size, got)
        for f in got:
            assert len(bytes(f)) == size
            ip = f[IPv6] if v6 else f[IP]
            tos = ip.tc if v6 else ip.tos
            assert tos >> 2 == 48 and tos & 3 == 1  # remarked, ECN kept
            if v6:
                assert ip.plen == size - 14 - 40
            else:
                assert ip.len == size - 14
            if l4 == "udp":
                assert f[UDP].len == size - 14 - (40 if v6 else 20)
            assert checksums_ok(f)


def test_a_packet_shorter_than_size_is_remarked_not_cut(rack4, sw):
    sw.apply(fragment(rack4, size=512, p=1.0))
    cap = Capture(rack4, "ps1", "udp and dst port 9")
    send_frames(rack4, "w1", frames(rack4, "w1", "ps1", "udp", False, 100))
    (f,) = cap.stop()
    assert len(bytes(f)) == 14 + 20 + 8 + 100 and f[IP].tos >> 2 == 48 and checksums_ok(f)


def test_jumbo_frames_trim_exactly(rack_factory):
    st = rack_factory(workers=1, ps=1, rate="1gbit", mtu=9000, platform="ideal")
    sw = st.vswitch()
    for v6 in (False, True):
        for size in (1024, 4096, 8000):
            sw.apply(fragment(st, size=size, p=1.0))
            cap = Capture(st, "ps1", "udp and dst port 9")
            send_frames(st, "w1", frames(st, "w1", "ps1", "udp", v6, 8900))
            (f,) = cap.stop()
            assert len(bytes(f)) == size and checksums_ok(f)


def test_ordinary_sockets_receive_trimmed_packets_ipv4_and_ipv6(rack4, sw):
    sw.apply(fragment(rack4, size=128, p=1.0))
    for v6 in (False, True):
        rx = Receiver(rack4, "ps1", v6=v6)
        burst = ns_python(rack4, "w1", "udp_burst", f"dst={host(rack4, 'ps1').data_ipv6 if v6 else host(rack4, 'ps1').data_ipv4}",
                          "count=200", "size=1000", f"tos={TOS}")
        burst.communicate(timeout=60)
        got = rx.result()
        assert len(got) == 200
        assert {n for *_, n, _, _ in [(g[0], g[1], g[2], g[3], 0) for g in got]} == {128 - 14 - (40 if v6 else 20) - 8}
        assert {g[3] for g in got} == {(48 << 2) | 1}


@pytest.mark.parametrize("v6", [False, True], ids=["ipv4", "ipv6"])
def test_gso_sends_are_trimmed_packet_by_packet(rack4, sw, v6):
    """trimlab's Sender hands the kernel runs of 64 equal datagrams (UDP GSO messages); the hosts'
    data ports segment before the switch, so the switch trims each segment on its own:
    its counters count segments, every segment arrives trimmed to exactly S with its own
    header, and the sender's capture sees wire packets, not super-packets."""
    sw.apply(fragment(rack4, size=128, p=1.0))
    ps = host(rack4, "ps1")
    dst = ps.data_ipv6 if v6 else ps.data_ipv4
    before = sw.counters()
    cap = Capture(rack4, "w1", "udp port 47001")
    rx = Receiver(rack4, "ps1", v6=v6)
    out, err = ns_python(rack4, "w1", "gso_burst", f"dst={dst}", "count=640", "size=1000", "dscp=10",
                         "tag=7").communicate(timeout=60)
    sent = json.loads(out)
    got = rx.result()
    frames = cap.stop()
    assert sent == {"gso": True, "gso_messages": 10, "sent": 640}, err  # 10 GSO sends of 64 segments
    q = delta(before, sw.counters())["queues"][PS_PORT][1]
    assert q["TRIM_PKTS"] == 640 and q["TRIM_TX_PKTS"] == 640
    assert sorted(seq for tag, seq, *_ in got if tag == 7) == list(range(640))  # each its own header
    assert {n for _, _, n, _, _ in got} == {128 - 14 - (40 if v6 else 20) - 8}
    assert frames and {len(f) for f in frames} == {14 + (40 if v6 else 20) + 8 + 1000}  # (tcpdump may drop some)


def test_drop_queue_drops_instead_of_trimming(rack4, sw):
    sw.apply(fragment(rack4, action="drop", budget=0))
    before = sw.counters()
    rx = Receiver(rack4, "ps1", idle=1.0)
    ns_python(rack4, "w1", "udp_burst", f"dst={host(rack4, 'ps1').data_ipv4}", "count=100", "size=1000",
              f"tos={TOS}").communicate(timeout=60)
    assert rx.result() == []
    d = delta(before, sw.counters())
    assert d["queues"][PS_PORT][1]["DROP_PKTS"] == 100
    assert d["switch"]["TRIM_PKTS"] == 0


def test_trim_queue_overflow_counts_trim_drops(rack4, sw):
    sw.apply(fragment(rack4, budget=0, trim_budget=0))
    before = sw.counters()
    rx = Receiver(rack4, "ps1", idle=1.0)
    ns_python(rack4, "w1", "udp_burst", f"dst={host(rack4, 'ps1').data_ipv4}", "count=100", "size=1000",
              f"tos={TOS}").communicate(timeout=60)
    assert rx.result() == []
    q = delta(before, sw.counters())["queues"][PS_PORT][1]
    assert q["TRIM_PKTS"] == 100 and q["TRIM_DRP_PKTS"] == 100 and q["TRIM_TX_PKTS"] == 0


def test_incast_trims_are_never_lost_and_counters_agree(rack4, sw):
    """4 → 1 incast of UDP bursts: congestion alone trims; every trimmed packet reaches the
    socket; switch = Σ ports = Σ queues = what the receiver saw."""
    sw.apply(fragment(rack4, size=128, budget=32768))
    ps = host(rack4, "ps1")
    before = sw.counters()
    rx = Receiver(rack4, "ps1", idle=2.0)
    senders = [ns_python(rack4, w, "udp_burst", f"dst={ps.data_ipv4}", "count=1500", "size=1400",
                         f"tos={TOS}", f"tag={i}") for i, w in enumerate(("w1", "w2", "w3", "w4"))]
    for s in senders:
        s.communicate(timeout=120)
    got = rx.result()
    d = delta(before, sw.counters())
    q1, q7 = d["queues"][PS_PORT][1], d["queues"][PS_PORT][7]
    trimmed = [g for g in got if g[2] == 128 - 42]
    assert q1["TRIM_PKTS"] > 100  # congestion trimmed
    assert q1["TX_PKTS"] + q1["TRIM_PKTS"] + q1["DROP_PKTS"] == 6000  # every packet accounted
    assert q1["TRIM_PKTS"] == q1["TRIM_TX_PKTS"] + q1["TRIM_DRP_PKTS"]
    assert q7["TX_PKTS"] == q1["TRIM_TX_PKTS"]  # trimmed packets go on queue 7
    assert len(trimmed) == q1["TRIM_TX_PKTS"]  # none lost at the socket
    assert len(got) == q1["TX_PKTS"] + q7["TX_PKTS"]
    assert d["switch"]["TX_PKTS"] == sum(p["TX_PKTS"] for p in d["ports"].values())
    for name, p in d["ports"].items():
        for c in ("TX_PKTS", "TRIM_PKTS", "DROP_PKTS", "TRIM_TX_PKTS", "TRIM_DRP_PKTS", "TX_BYTES"):
            assert p[c] == sum(q[c] for q in d["queues"][name])
    assert max(q["PEAK_OCCUPANCY"] for q in sw.counters()["queues"][PS_PORT]) <= 32768
    # the receiver waited 2 s idle: occupancy is read drained to now, so the queues read empty
    assert all(q["OCCUPANCY"] == 0 for q in sw.counters()["queues"][PS_PORT])
    snmp = subprocess.run(["ip", "netns", "exec", ps.ns, "cat", "/proc/net/snmp"], capture_output=True,
                          text=True).stdout.splitlines()
    udp = dict(zip(*[line.split()[1:] for line in snmp if line.startswith("Udp:")]))
    assert udp["RcvbufErrors"] == "0" and udp["InCsumErrors"] == "0"


def test_trimmed_packets_overtake_queued_data(rack4, sw):
    sw.apply(fragment(rack4, size=128, budget=48000))
    ps = host(rack4, "ps1")
    rx = Receiver(rack4, "ps1", idle=2.0)
    senders = [ns_python(rack4, w, "udp_burst", f"dst={ps.data_ipv4}", "count=600", "size=1400",
                         f"tos={TOS}", f"tag={i}") for i, w in enumerate(("w1", "w2"))]
    for s in senders:
        s.communicate(timeout=120)
    got = rx.result()
    order = {(tag, seq): i for i, (tag, seq, *_rest) in enumerate(got)}
    full = [(t, s) for t, s, n, *_ in got if n == 1400]
    trimmed = [(t, s) for t, s, n, *_ in got if n == 128 - 42]
    assert trimmed, "no congestion"
    # Some trimmed packet arrived before a full packet of the same sender that was sent earlier.
    overtakes = sum(1 for t, s in trimmed for ft, fs in full if ft == t and fs < s and order[(ft, fs)] > order[(t, s)])
    assert overtakes > 0


def test_toggling_trim_and_drop_keeps_counters(rack4, sw):
    ps = host(rack4, "ps1")
    seen = sw.counters()["switch"]
    for i in range(10):
        action = "trim" if i % 2 == 0 else "drop"
        sw.apply(fragment(rack4, action=action, budget=0))
        ns_python(rack4, "w1", "udp_burst", f"dst={ps.data_ipv4}", "count=20", "size=600",
                  f"tos={TOS}").communicate(timeout=60)
        now = sw.counters()["switch"]
        assert all(now[k] >= seen[k] for k in now)
        grew = "TRIM_PKTS" if action == "trim" else "DROP_PKTS"
        assert now[grew] - seen[grew] == 20
        seen = now
        assert sw.read().actions[PS_PORT][1] == action


def test_deterministic_injection_pairs_trim_and_drop_runs(rack4, sw, tmp_path):
    import torch

    from trimlab import wire
    from trimlab.codec import get_codec

    ps = host(rack4, "ps1")
    pays = wire.packetize(torch.randn(300_000), get_codec("embedded"), ids=wire.PacketIds(job=3, step=1), seed=1)
    path = tmp_path / "payloads.hex"
    path.write_text("\n".join(p.hex() for p in pays))

    def run(action):
        sw.apply(fragment(rack4, p=0.25, inject=action, seed=99))
        before = sw.counters()
        rx = Receiver(rack4, "ps1", port=47000, idle=1.0)
        ns_python(rack4, "w1", "send_payloads", f"dst={ps.data_ipv4}", f"path={path}", f"tos={TOS}").communicate(timeout=120)
        got = rx.result()
        return got, delta(before, sw.counters())["queues"][PS_PORT][1]

    trim_got, trim_c = run("trim")
    drop_got, drop_c = run("drop")
    again, _ = run("trim")
    ident = lambda g: g[4][6:8] + g[4][28:32]  # packet index, span
    sent = {p[3:4].hex() + p[14:16].hex(): len(p) for p in pays}
    trimmed = {ident(g) for g in trim_got if g[2] < sent[ident(g)]}
    assert trimmed == {ident(g) for g in again if g[2] < sent[ident(g)]}  # same seed, same packets
    assert 0.15 * len(pays) < len(trimmed) < 0.35 * len(pays)
    kept_in_drop_run = {ident(g) for g in drop_got}
    assert kept_in_drop_run.isdisjoint(trimmed) and len(kept_in_drop_run) + len(trimmed) == len(pays)
    assert trim_c["TRIM_PKTS"] == len(trimmed) and drop_c["DROP_PKTS"] == len(trimmed)


def _sent_again(frames) -> int:
    """Data segments in a sender's capture that start below the highest sequence number
    already sent: TCP's retransmissions, as the wire saw them."""
    top, again = None, 0
    for f in frames:
        seg = f[TCP]
        n = len(seg.payload)
        if not n:
            continue
        if top is not None and (seg.seq - top) & 0x80000000:  # before `top`, modulo 2^32
            again += 1
        end = (seg.seq + n) & 0xFFFFFFFF
        if top is None or not (end - top) & 0x80000000:
            top = end
    return again


def test_injection_reaches_tcp_on_its_own_class_and_every_drop_is_retransmitted(rack4, sw):
    """gloo's stand-in: TCP on DSCP 0 (queue 0, a queue that drops) with injection told to
    reach queue 0 only. Every data segment the switch dropped is one segment TCP
    retransmitted, counted twice over the data phase alone: from the sender's capture and
    by the connection itself (TCP_INFO). The receiver's ACKs travel on DSCP 46 (a queue
    injection does not reach), and tail-loss probes are off on the sender, so no
    retransmission is spurious."""
    ps, w1 = host(rack4, "ps1"), host(rack4, "w1")
    sw.apply(fragment(rack4, p=0.05, inject="drop", seed=7, inject_queues="0"))
    assert sw.read().inject_queues == [0]
    sysctl = ["ip", "netns", "exec", w1.ns, "sysctl"]
    was = subprocess.run([*sysctl, "-n", "net.ipv4.tcp_early_retrans"], capture_output=True, text=True,
                         check=True).stdout.strip()
    subprocess.run([*sysctl, "-qw", "net.ipv4.tcp_early_retrans=0"], check=True)
    sink = ns_python(rack4, "ps1", "tcp_sink", "port=47100", f"tos={46 << 2}")
    send = cap = None
    try:
        assert sink.stdout.readline().strip() == "listening"
        send = ns_python(rack4, "w1", "tcp_send", f"dst={ps.data_ipv4}", "port=47100", "size=3000000",
                         stdin=subprocess.PIPE)
        assert send.stdout.readline().strip() == "connected"
        cap = Capture(rack4, "w1", f"tcp and dst host {ps.data_ipv4} and dst port 47100")
        before = sw.counters()
        send.stdin.write("go\n")
        send.stdin.flush()
        retransmitted = int(send.stdout.readline())
        q = delta(before, sw.counters())["queues"][PS_PORT]
        captured = _sent_again(cap.stop())
        send.stdin.write("close\n")
        send.stdin.flush()
        assert send.wait(timeout=60) == 0, send.stderr.read()
        assert int(sink.communicate(timeout=60)[0].strip()) == 3_000_000
    finally:
        for proc in (send, sink, cap and cap.proc):
            if proc and proc.poll() is None:
                proc.kill()
                proc.wait()
        if cap:
            cap.path.unlink(missing_ok=True)
        subprocess.run([*sysctl, "-qw", f"net.ipv4.tcp_early_retrans={was}"], check=True)
    assert q[0]["DROP_PKTS"] > 0 and q[0]["TRIM_PKTS"] == 0
    assert q[0]["DROP_PKTS"] == captured == retransmitted, (q[0], captured, retransmitted)


@pytest.mark.parametrize("bad,msg", [
    ({"SWITCH_TRIMMING": {"GLOBAL": {"dscp_value": "100"}}}, "SWITCH_TRIMMING|GLOBAL.dscp_value: 100 is out of range (0..63)"),
    ({"SWITCH_TRIMMING": {"GLOBAL": {"queue_index": "20"}}}, "SWITCH_TRIMMING|GLOBAL.queue_index: 20 is out of range (0..7)"),
    ({"SWITCH_TRIMMING": {"GLOBAL": {"size": "40"}}}, "SWITCH_TRIMMING|GLOBAL.size: 40 is out of range (62..1514)"),
    ({"SWITCH_TRIMMING": {"GLOBAL": {"size": "2000"}}}, "SWITCH_TRIMMING|GLOBAL.size: 2000 is out of range (62..1514)"),
    ({"BUFFER_PROFILE": {"x": {"static_th": "1", "packet_discard_action": "mirror"}}}, "packet_discard_action: 'mirror'; use trim or drop"),
    ({"BUFFER_PROFILE": {"x": {"static_th": "1"}}, "BUFFER_QUEUE": {"Ethernet99|1": {"profile": "x"}}}, "port Ethernet99 does not exist"),
    ({"DSCP_TO_TC_MAP": {"m": {"64": "1"}}}, "DSCP_TO_TC_MAP|m: 64 is out of range (0..63)"),
    ({"SWITCH_TRIMMING": {"GLOBAL": {"size": "256"}}, "PORT": {"Ethernet1": {"speed": "10"}}}, "PORT|Ethernet1: port does not exist"),
])
def test_bad_configuration_is_one_clear_error_and_changes_nothing(rack4, sw, bad, msg):
    before = sw.read()
    with pytest.raises(SpecError, match=msg.replace("|", r"\|").replace("(", r"\(").replace(")", r"\)")):
        sw.apply(bad)
    assert sw.read() == before


def test_switch_cli_apply_show_counters(rack4, sw, tmp_path):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(fragment(rack4, size=256, dscp_value=46)))
    cli = [sys.executable, "-m", "trimlab.testbed.cli"]
    out = subprocess.run(cli + ["switch", "apply", str(cfg), "--id", rack4.id], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    shown = json.loads(subprocess.run(cli + ["switch", "show", "--id", rack4.id], capture_output=True,
                                      text=True, check=True).stdout)
    assert shown["SWITCH_TRIMMING"]["GLOBAL"] == {"size": "256", "dscp_value": "46", "queue_index": "7"}
    c = json.loads(subprocess.run(cli + ["switch", "counters", "--json", "--id", rack4.id],
                                  capture_output=True, text=True, check=True).stdout)
    assert set(c) == {"switch", "ports", "queues"} and "TRIM_DRP_PKTS" in c["switch"]
    cfg.write_text('{"SWITCH_TRIMMING": {"GLOBAL": {"size": "9"}}}')
    bad = subprocess.run(cli + ["switch", "apply", str(cfg), "--id", rack4.id], capture_output=True, text=True)
    assert bad.returncode == 2 and "size: 9 is out of range" in bad.stderr and "Traceback" not in bad.stderr
