"""Matching: synthetic runs with known trims and drops give the exact per-packet table, and
every injected discrepancy between the observers is reported as one."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from tests.unit.synthrun import Synth
from trimlab import wire
from trimlab.analysis import match
from trimlab.analysis.rundata import RunData
from trimlab.codec import CodecContext, get_codec, measure

TRIMS = {(0, 0, 0, 1): 60, (0, 1, 0, 3): 60, (1, 0, 0, 0): 120, (2, 1, 0, 2): 0, (3, 0, 0, 5): 61}
DROPS = {(1, 1, 0, 4), (2, 0, 0, 0)}


def statuses(chk) -> dict[str, str]:
    return {c["check"]: c["status"] for c in chk}


def build(tmp_path, **kw):
    s = Synth(trims=dict(TRIMS), drops=set(DROPS), **kw)
    return s, RunData.open(s.write(tmp_path / "run"))


@pytest.mark.parametrize("codec", ["embedded", "sign_tail", "fp32"])
def test_exact_table_and_all_observers_agree(tmp_path, codec):
    s, run = build(tmp_path, codec=codec, coords=352)
    rows, chk = match.write(run.path)
    per_bucket = len(get_codec(codec).encode(torch.zeros(s.numel), CodecContext(span=4096, coords=352)).span)
    assert len(rows) == s.steps * 2 * per_bucket
    key = lambda r: (r.step, r.rank, r.span, r.packet)  # noqa: E731
    assert {key(r) for r in rows[rows["trimmed"]].itertuples()} == set(TRIMS)
    assert {key(r) for r in rows[rows["dropped"]].itertuples()} == DROPS
    for r in rows[rows["trimmed"]].itertuples():
        assert r.recv_len == wire.HEADER_LEN + TRIMS[key(r)] and r.dscp_recv == 48 and r.dscp_sent == 10
        assert r.trimmed_at == "Ethernet8"  # one switch: the ps's port, the only one on the path
        assert r.planes == min(8 * TRIMS[key(r)] // r.coords, get_codec(codec).planes)
    assert rows.loc[~rows["trimmed"], "trimmed_at"].isna().all()
    whole = rows[~rows["trimmed"] & ~rows["dropped"]]
    assert (whole["recv_len"] == whole["sent_len"]).all() and ((whole["delay_us"] - 50).abs() < 2).all()
    assert rows["dropped"].eq(rows["recv_len"].isna()).all()
    assert (rows.loc[rows["dropped"], "expected_nmse"] == 1.0).all()
    # true error: steps 0 and 2 have truth; a lost packet lost all of its energy
    truth = rows[rows["nmse"].notna()]
    assert set(truth["step"]) == {0, 2}
    assert np.allclose(truth.loc[truth["dropped"], "nmse"], 1.0)
    assert (truth.loc[~truth["trimmed"] & ~truth["dropped"], "nmse"] < 1e-5).all()
    cut = truth[truth["trimmed"]]
    assert ((cut["nmse"] > 0.05) & (cut["nmse"] <= 1.0 + 1e-9)).all()
    # the table joins the right truth and length: its NMSE is that packet's error at what arrived
    step, rank, span, packet, recv_len, nmse = (int(v) if k != "nmse" else v for k, v in
                                                cut.iloc[0][["step", "rank", "span", "packet", "recv_len", "nmse"]].items())
    c = get_codec(codec)
    g = s.gradient(step, rank)
    ctx = CodecContext(seed=7, step=step, bucket=0, span=4096, coords=352)
    pk = c.encode(g, ctx)
    one = ((pk.span == span) & (pk.index == packet)).nonzero()[0, 0]
    e = measure.packet_errors(c, g, ctx, pk.span[one:one + 1], pk.index[one:one + 1],
                              torch.tensor([recv_len - wire.HEADER_LEN]))
    assert np.isclose(nmse, float(e["error"][0] / e["energy"][0]))
    assert all(v == match.AGREE for v in statuses(chk).values()), chk
    saved = json.loads((run.path / "checks.json").read_text())
    assert saved["all_agree"] and len(saved["checks"]) == len(chk)
    table = pd.read_parquet(run.path / "packets.parquet")
    assert list(table.columns) == match.COLUMNS and len(table) == len(rows)


def test_packet_errors_sum_to_the_bucket_error_without_padding():
    c = get_codec("embedded")
    x = torch.randn(8192)  # two whole spans: the rotated-domain error equals the real one
    ctx = CodecContext(seed=1, step=3, span=4096, coords=512)
    pk = c.encode(x, ctx)
    nbytes = pk.length.clone()
    nbytes[::3] = 64
    dec = c.decode(pk.truncated(nbytes), ctx, x.numel())
    e = measure.packet_errors(c, x, ctx, pk.span, pk.index, nbytes)
    assert np.isclose(float(e["error"].sum()), float(((dec.tensor - x) ** 2).sum()), rtol=1e-4)
    assert torch.equal(e["scale"].float(), pk.scale)


def test_switch_counter_off_by_one_disagrees(tmp_path):
    _, run = build(tmp_path, switch_trim_error=1)
    st = statuses(match.match(run)[1])
    assert st["switch trims = capture (s-ps1)"] == match.DISAGREE
    assert st["switch trims = ps log (s-ps1)"] == match.DISAGREE
    assert st["capture = ps log (s-ps1)"] == match.AGREE


def test_packet_captured_but_not_logged_disagrees_unless_counted_late(tmp_path):
    _, run = build(tmp_path, unlogged={(3, 1, 0, 2)})
    chk = {c["check"]: c for c in match.match(run)[1]}
    assert chk["capture = ps log (s-ps1)"]["status"] == match.DISAGREE
    assert "1 captured but not logged" in chk["capture = ps log (s-ps1)"]["detail"]
    _, run = build(tmp_path / "late", unlogged={(3, 1, 0, 2)}, late=1)
    assert statuses(match.match(run)[1])["capture = ps log (s-ps1)"] == match.EXPLAINED


def test_capture_that_lost_packets_says_so(tmp_path):
    _, run = build(tmp_path, uncaptured={(0, 0, 0, 1)}, tcpdump_dropped=1)
    rows, chk = match.match(run)
    st = statuses(chk)
    assert st["capture s-ps1"] == match.EXPLAINED
    assert st["capture = ps log (s-ps1)"] == match.EXPLAINED
    assert st["switch trims = capture (s-ps1)"] == match.EXPLAINED  # the lost one was a trim
    r = rows[(rows["step"] == 0) & (rows["rank"] == 0) & (rows["packet"] == 1)].iloc[0]
    assert r.trimmed and not r.dropped and r.logged and not r.seen_receiver  # the log still saw it
    _, run = build(tmp_path / "silent", uncaptured={(0, 0, 0, 1)})
    assert statuses(match.match(run)[1])["capture = ps log (s-ps1)"] == match.DISAGREE


def test_wire_that_differs_from_its_truth_disagrees(tmp_path):
    _, run = build(tmp_path, corrupt_scale=(0, 1, 0, 0))
    chk = {c["check"]: c for c in match.match(run)[1]}
    assert chk["truth re-encoding = wire"]["status"] == match.DISAGREE
    assert chk["truth re-encoding = wire"]["observed"] == chk["truth re-encoding = wire"]["expected"] - 1


def test_drop_counter_against_packets_never_received(tmp_path):
    s = Synth(trims=dict(TRIMS), drops=set(DROPS))
    run = RunData.open(s.write(tmp_path / "run"))
    doc = json.loads((run.path / "switch" / "counters_after.json").read_text())
    # drops on the control class (queue 5: parameters, sent again by the reliable channel)
    # lose no gradient: they leave the check as it was
    doc["ports"]["Ethernet8"]["DROP_PKTS"] += 3
    doc["queues"]["Ethernet8"][5]["DROP_PKTS"] += 3
    (run.path / "switch" / "counters_after.json").write_text(json.dumps(doc))
    c = {c["check"]: c for c in match.match(RunData.open(run.path))[1]}["switch drops = never received (s-ps1)"]
    assert c["status"] == match.AGREE and (c["expected"], c["observed"]) == (len(DROPS), len(DROPS))
    doc["ports"]["Ethernet8"]["DROP_PKTS"] += 2  # two more in the gradients' queue: a disagreement
    doc["queues"]["Ethernet8"][1]["DROP_PKTS"] += 2
    (run.path / "switch" / "counters_after.json").write_text(json.dumps(doc))
    chk = {c["check"]: c for c in match.match(RunData.open(run.path))[1]}
    c = chk["switch drops = never received (s-ps1)"]
    assert c["status"] == match.DISAGREE and (c["expected"], c["observed"]) == (len(DROPS) + 2, len(DROPS))


def test_a_background_flow_that_fell_short_disagrees_and_says_by_how_much(tmp_path):
    """Offered load is measured (the sender's bytes over its on-time), never assumed: a flow
    within 3 % of its request agrees, one at 10.9 of 19 Mbit/s disagrees, one with no
    summary disagrees too."""
    s = Synth(trims=dict(TRIMS), drops=set(DROPS))
    path = s.write(tmp_path / "run")
    m = json.loads((path / "manifest.json").read_text())
    m["spec"]["congestion"]["background"] = [{"rate": "19mbit"}, {"rate": "19mbit"}, {"rate": "5mbit"}]
    (path / "manifest.json").write_text(json.dumps(m))
    for i, offered in ((0, 18.5e6), (1, 10.9e6)):
        (path / "logs" / f"s-tr1-traffic{i}.log").write_text(json.dumps(
            {"event": "summary", "role": "send", "bytes": 1, "on_s": 2.0, "rate_bps": 19e6, "offered_bps": offered}) + "\n")
    chk = {c["check"]: c for c in match.load_checks(RunData.open(path))}
    assert chk["offered load = requested (flow 0)"]["status"] == match.AGREE
    short = chk["offered load = requested (flow 1)"]
    assert short["status"] == match.DISAGREE and (short["expected"], short["observed"]) == (19.0, 10.9)
    assert short["detail"].startswith("flow 1 offered 10.9 of 19.0 Mbit/s (57.4%")
    assert chk["offered load = requested (flow 2)"]["status"] == match.DISAGREE


def with_traffic_port(path, rx_packets: int, rx_bytes: int) -> RunData:
    """Record the traffic host's switch port (Ethernet12) and what it received over the run."""
    m = json.loads((path / "manifest.json").read_text())
    m["hosts"]["s-tr1"] = {"role": "traffic", "data_ipv4": "198.19.0.15", "switch": "sw", "switch_port": "Ethernet12"}
    (path / "manifest.json").write_text(json.dumps(m))
    for name, (pkts, nbytes) in (("before", (5, 300)), ("after", (5 + rx_packets, 300 + rx_bytes))):
        f = path / "switch" / f"counters_{name}.json"
        doc = json.loads(f.read_text())
        doc["ports"]["Ethernet12"] = {"RX_PKTS": pkts, "RX_BYTES": nbytes}
        f.write_text(json.dumps(doc))
    return RunData.open(path)


def test_the_switch_port_is_a_second_observer_of_each_traffic_hosts_load(tmp_path):
    """The bytes the traffic host's senders handed the kernel against the payload the
    switch's port received from that host (its RX counters less each frame's Ethernet, IP
    and UDP headers): equal agrees; a sender that counted datagrams its own host never put
    on the wire disagrees. The manifest's flow says what each observer saw."""
    from trimlab.testbed.orchestrator.artifacts import background_flow
    path = Synth(trims=dict(TRIMS), drops=set(DROPS)).write(tmp_path / "run")
    m = json.loads((path / "manifest.json").read_text())
    m["spec"]["congestion"]["background"] = [{"rate": "14mbit"}]
    (path / "manifest.json").write_text(json.dumps(m))
    (path / "logs" / "s-tr1-traffic0.log").write_text(json.dumps(
        {"event": "summary", "role": "send", "bytes": 3_500_000, "on_s": 2.0, "rate_bps": 14e6,
         "offered_bps": 14e6, "paced_by": "htb 1:bb80"}) + "\n")
    (path / "logs" / "s-ps1-sink0.log").write_text(json.dumps(
        {"event": "summary", "role": "sink", "bytes": 3_000_000, "packets": 2500}) + "\n")
    frame = 1400 + 14 + 28  # the datagrams the sender sent, as frames
    run = with_traffic_port(path, 2500, 2500 * frame)
    c = {c["check"]: c for c in match.load_checks(run)}["background bytes = switch port in (s-tr1)"]
    assert c["status"] == match.AGREE and c["observed"] == 3_500_000, c
    flow = background_flow(run, 0)
    assert flow["offered_bps"] == flow["at_switch_bps"] == 14e6 and flow["received_bps"] == 12e6, flow
    short = with_traffic_port(path, 1250, 1250 * frame)  # half of it never reached the switch
    c = {c["check"]: c for c in match.load_checks(short)}["background bytes = switch port in (s-tr1)"]
    assert c["status"] == match.DISAGREE and c["detail"].startswith("flow 0: senders handed the kernel 3500000 bytes"), c


def test_the_hooks_pacing_is_measured_on_the_wire(tmp_path):
    """Each worker's pacing, from its own capture (every step's packets, first to last),
    against the rate asked: the synthetic senders' packets leave 100 µs apart, so 50 Mbit/s
    was held and 500 Mbit/s was not; a run without pacing has no such check."""
    assert not [c for c in match.match(build(tmp_path / "none")[1])[1] if c["check"].startswith("hook pacing")]
    _, run = build(tmp_path / "held", pacing_bps=50_000_000)
    chk = {c["check"]: c for c in match.pacing_checks(run)}
    assert set(chk) == {"hook pacing = requested (s-w1)", "hook pacing = requested (s-w2)"}
    held = chk["hook pacing = requested (s-w1)"]
    assert held["status"] == match.AGREE and 50 < held["observed"] < 100, held
    _, run = build(tmp_path / "short", pacing_bps=500_000_000)
    short = {c["check"]: c for c in match.pacing_checks(run)}["hook pacing = requested (s-w2)"]
    assert short["status"] == match.DISAGREE and short["detail"].startswith("s-w2 sent its gradients at "), short
    assert short["observed"] == chk["hook pacing = requested (s-w2)"]["observed"]  # the same packets, measured alike


def with_repair(run, repaired=None, refused=0, platform="sonic"):
    """Record the switch's platform and the receiver's repair counters (None: no repair)."""
    m = json.loads((run.path / "manifest.json").read_text())
    stale = [] if platform == "ideal" else ["ip_length", "ipv4_checksum", "udp_length", "l4_checksum"]
    m["platforms"] = {"sw": {"name": platform, "stale": stale, "needs_repair": bool(stale)}}
    (run.path / "manifest.json").write_text(json.dumps(m))
    zero = {"seen": 0, "repaired": 0, "refused": 0}
    before = {"s-ps1": None if repaired is None else {"port": 47000, "prog_id": 1, "counters": zero}}
    after = {"s-ps1": None if repaired is None else
             {"port": 47000, "prog_id": 1, "counters": {"seen": 99, "repaired": repaired, "refused": refused}}}
    (run.path / "repair_before.json").write_text(json.dumps(before))
    (run.path / "repair_after.json").write_text(json.dumps(after))
    return RunData.open(run.path)


def test_the_receive_repair_is_a_fourth_observer(tmp_path):
    _, run = build(tmp_path)
    trims = len(TRIMS)
    chk = {c["check"]: c for c in match.match(with_repair(run, repaired=trims))[1]}
    c = chk["capture trims = repaired (s-ps1)"]
    assert (c["status"], c["expected"], c["observed"]) == (match.AGREE, trims, trims)
    c = {c["check"]: c for c in match.match(with_repair(run, repaired=trims - 1))[1]}["capture trims = repaired (s-ps1)"]
    assert c["status"] == match.DISAGREE
    c = {c["check"]: c for c in match.match(with_repair(run, repaired=trims, refused=2))[1]}["capture trims = repaired (s-ps1)"]
    assert c["status"] == match.DISAGREE and "refused 2 inconsistent trimlab frames" in c["detail"]


def test_without_the_repair_the_checks_name_the_stale_lengths(tmp_path):
    # what a host without the repair sees behind a real switch: the trims reach its port
    # (the capture) and never its socket (the log)
    received_trims = {k for k in TRIMS}
    _, run = build(tmp_path, unlogged=received_trims, late=len(received_trims))
    chk = {c["check"]: c for c in match.match(with_repair(run, repaired=None))[1]}
    c = chk["trimmed packets reach the socket (s-ps1)"]
    assert c["status"] == match.DISAGREE and (c["expected"], c["observed"]) == (len(TRIMS), 0)
    assert (f"{len(TRIMS)} trimmed packets reached s-ps1's port but not its socket: the switch leaves lengths "
            "stale (sw (sonic: ip_length, ipv4_checksum, udp_length, l4_checksum stale)) and s-ps1 has no "
            "receive repair") in c["detail"]
    # the ideal switch rewrites every length: no repair needed, no such check
    chk = {c["check"] for c in match.match(with_repair(run, repaired=None, platform="ideal"))[1]}
    assert not any(c.startswith("trimmed packets reach the socket") for c in chk)


def test_injection_is_measured_against_its_probability(tmp_path):
    """What the switch cut on the queues injection reaches, against p: the synthetic run's
    trims and drops (its only cuts) agree with their own share, and disagree with a p
    they fall far short of; injection aimed at a queue no packet crossed disagrees too."""
    s = Synth(trims=dict(TRIMS), drops=set(DROPS))
    path = s.write(tmp_path / "run")
    prof = path / "switch" / "default.yml"
    base = yaml.safe_load(prof.read_text())
    after = path / "switch" / "counters_after.json"
    doc = json.loads(after.read_text())
    for qs in doc["queues"].values():
        qs[1] = qs[1] | {"TX_PKTS": 1000}  # the packets that passed uncut
    after.write_text(json.dumps(doc))
    c = RunData.open(path).counters
    q1 = [qs[1] for qs in c["queues"].values()]
    cut = sum(q["TRIM_PKTS"] + q["DROP_PKTS"] for q in q1)
    total = sum(q["TX_PKTS"] + q["TRIM_PKTS"] + q["DROP_PKTS"] for q in q1)
    assert cut > 0
    for p, queues, status in ((cut / total, [], match.AGREE), (10 * cut / total, [], match.DISAGREE),
                              (cut / total, [4], match.DISAGREE)):
        prof.write_text(yaml.safe_dump(base | {"injection": {"probability": p, "queues": queues}}))
        (chk,) = match.injection_checks(RunData.open(path))
        assert chk["check"] == "injected share = requested" and chk["status"] == status, chk
    prof.write_text(yaml.safe_dump(base))  # no injection: no check
    assert match.injection_checks(RunData.open(path)) == []
