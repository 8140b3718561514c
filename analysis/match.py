"""One row per gradient packet sent, joined from every observer, and the checks that the
observers of each trim (switch counters, the receiver's capture, its receive repair, the
ps log) agree.

    packets, checks = match(RunData.open(run_dir))
    write(run_dir)   # packets.parquet and checks.json in the run directory

A packet's identity is (step, rank, bucket, span, packet): the trimlab header's. The rows
come from the codec's layout of every bucket each worker reported sending (metrics.csv), so
a packet no observer saw is still a row (dropped). Its true error is measured by re-encoding
the worker's saved gradient (truth/) with the run's codec and seed, deterministically, and
decoding it at the length that arrived.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from trimlab import rundir, wire
from trimlab.analysis.rundata import RunData, RunDataError
from trimlab.codec import CodecContext, measure
from trimlab.config import TRAFFIC_PORT, AgentConfig

KEY = ["step", "rank", "bucket", "span", "packet"]
COLUMNS = ["job", *KEY, "sender", "receiver", "coords", "sent_len", "t_sent_ns", "dscp_sent",
           "seen_sender", "t_recv_ns", "recv_len", "dscp_recv", "seen_receiver", "logged", "status",
           "trimmed", "trimmed_at", "dropped", "planes", "bits_per_coord", "delay_us", "expected_nmse", "nmse"]
AMBIGUOUS = "ambiguous"
# a check's status: agree (green), explained (a known cause, e.g. a capture that lost
# packets, said so), disagree (red), n/a (this run cannot tell)
AGREE, EXPLAINED, DISAGREE, NA = "agree", "explained", "disagree", "n/a"


# -- the rows ---------------------------------------------------------------------------------

def _layout_rows(codec, numel: int, cfg: AgentConfig, bucket: int) -> pd.DataFrame:
    """(span, packet, coords) of every packet of one bucket, in the codec's layout."""
    c = cfg.codec
    lay = codec.layout(numel, CodecContext(seed=cfg.seed, bucket=bucket, span=c.span, coords=c.coords))
    parts = []
    for b in lay.blocks:
        g = b.group
        parts.append(pd.DataFrame({
            "span": np.repeat(np.arange(g.first, g.first + g.count), b.per_span),
            "packet": np.tile(np.arange(b.first_index, b.first_index + b.per_span), g.count),
            "coords": b.coords}))
    return pd.concat(parts, ignore_index=True)


def sent_packets(run: RunData) -> pd.DataFrame:
    """Every gradient packet the workers sent, by the layout and the steps they reported."""
    cfg = run.cfg
    codec = run.codec
    parts = []
    for rank, w in enumerate(cfg.workers):
        lay = run.layout(rank)
        m = run.metrics
        steps = np.sort(m.loc[m["rank"] == rank, "step"].unique()) if len(m) else np.zeros(0, dtype=int)
        if lay is None or not len(steps):
            continue
        by_layout: dict[str, list[int]] = {}  # steps that share a bucket layout
        for step in steps:
            by_layout.setdefault(json.dumps(lay.at_step(int(step))), []).append(int(step))
        for key, group in by_layout.items():
            buckets, owners = (({int(k): v for k, v in d.items()}) for d in json.loads(key))
            for b, (lo, hi) in buckets.items():
                owner = owners.get(b, b) if cfg.topology == "sharded" else None
                if owner == rank:
                    continue  # an owner's own shard never crosses the network
                receiver = cfg.workers[owner].name if owner is not None else cfg.ps.name
                one = _layout_rows(codec, hi - lo, cfg, b)
                rows = one.loc[np.tile(one.index, len(group))].reset_index(drop=True)
                rows.insert(0, "step", np.repeat(group, len(one)))
                parts.append(rows.assign(rank=rank, bucket=b, sender=w.name, receiver=receiver))
    if not parts:
        return pd.DataFrame(columns=[*KEY, "coords", "sender", "receiver"])
    out = pd.concat(parts, ignore_index=True)
    out["sent_len"] = wire.HEADER_LEN + (codec.body_bytes(32) * out["coords"]) // 32
    out["job"] = cfg.job
    return out


def _seen(cap: pd.DataFrame | None, cfg: AgentConfig, **where) -> pd.DataFrame:
    """A capture's trimlab gradient packets of this job (src/dst as given), one per key."""
    cols = [*KEY, "ts_ns", "dscp", "length", "udp_payload", "scale"]
    if cap is None:
        return pd.DataFrame(columns=cols)
    sel = cap["trimlab"].to_numpy() & (cap["dport"].to_numpy() == cfg.transport.port) \
        & (cap["job"].to_numpy() == cfg.job)
    for col, addr in where.items():
        sel &= (cap[col] == addr).to_numpy()
    return cap.loc[sel, cols].drop_duplicates(KEY)


def _truth_errors(run: RunData, rows: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """True per-packet NMSE (and the re-encoded header scale) for the steps with truth."""
    cfg, codec = run.cfg, run.codec
    nmse = pd.Series(np.nan, index=rows.index)
    scale = pd.Series(np.nan, index=rows.index)
    for step, rank in run.truth_steps:
        g = run.truth(step, rank)
        lay = run.layout(rank) if rank < len(cfg.workers) else None
        if g is None or lay is None:
            continue
        for b, (lo, hi) in lay.at_step(step)[0].items():
            sel = rows[(rows["step"] == step) & (rows["rank"] == rank) & (rows["bucket"] == b)]
            if sel.empty:
                continue
            ctx = CodecContext(seed=cfg.seed, step=step, bucket=b, span=cfg.codec.span, coords=cfg.codec.coords)
            got = np.where(sel["dropped"], -1, sel["recv_len"].fillna(sel["sent_len"]) - wire.HEADER_LEN)
            e = measure.packet_errors(codec, torch.tensor(g[lo:hi]), ctx, torch.tensor(sel["span"].to_numpy()),
                                      torch.tensor(sel["packet"].to_numpy()), torch.tensor(got.astype(np.int64)))
            energy = e["energy"].numpy()
            nmse.loc[sel.index] = np.where(energy > 0, e["error"].numpy() / np.where(energy > 0, energy, 1), 0.0)
            scale.loc[sel.index] = e["scale"].numpy()
    return nmse, scale


def packet_table(run: RunData) -> tuple[pd.DataFrame, dict]:
    """The per-packet table, and what the checks need beside it."""
    cfg = run.cfg
    if cfg is None:
        raise RunDataError(f"{run.path}: no {rundir.AGENT_CONFIG}; the run failed before its agents started")
    rows = sent_packets(run)
    addr = {h: v["addr"] for h, v in run.hosts.items()}
    side: dict = {"captures": {}, "sender_scale": None}
    snd, rcv = [], []
    for w in cfg.workers:
        cap = run.capture(w.name)
        side["captures"][w.name] = cap
        snd.append(_seen(cap, cfg, src=w.addr))
    for r in run.receivers:
        cap = side["captures"].get(r) if r in side["captures"] else run.capture(r)
        side["captures"][r] = cap
        rcv.append(_seen(cap, cfg, dst=addr.get(r)).assign(receiver=r))
    s = pd.concat(snd, ignore_index=True).rename(columns={"ts_ns": "t_sent_ns", "dscp": "dscp_sent",
                                                          "scale": "wire_scale", "length": "wire_length"})
    r = pd.concat(rcv, ignore_index=True).rename(columns={"ts_ns": "t_recv_ns", "dscp": "dscp_recv"})
    r["recv_len"] = r["udp_payload"]  # the frame's: a switch may leave the lengths stale
    rows = rows.merge(s[[*KEY, "t_sent_ns", "dscp_sent", "wire_scale", "wire_length"]], on=KEY, how="left")
    rows = rows.merge(r[[*KEY, "t_recv_ns", "dscp_recv", "recv_len"]], on=KEY, how="left")
    rows["seen_sender"] = rows["t_sent_ns"].notna()
    rows["seen_receiver"] = rows["t_recv_ns"].notna()
    log = run.packet_log
    if len(log):
        log = log.sort_values("status", key=lambda st: st != "accepted", kind="stable").drop_duplicates(KEY)
        log = log[[*KEY, "recv_len", "trimmed", "planes", "status", "dscp"]].rename(
            columns={"recv_len": "log_len", "trimmed": "log_trimmed", "planes": "log_planes", "dscp": "log_dscp"})
        rows = rows.merge(log, on=KEY, how="left")
    else:
        rows = rows.assign(log_len=np.nan, log_trimmed=np.nan, log_planes=np.nan, status=None, log_dscp=np.nan)
    rows["logged"] = rows["status"].notna()
    rows["recv_len"] = rows["recv_len"].fillna(rows["log_len"])
    rows["dscp_recv"] = rows["dscp_recv"].fillna(rows["log_dscp"])
    received = rows["seen_receiver"] | rows["logged"]
    rows["dropped"] = ~received
    rows["trimmed"] = received & (rows["recv_len"] < rows["sent_len"])
    body = (rows["recv_len"].fillna(0) - wire.HEADER_LEN).clip(lower=0).astype(np.int64)
    body = body.where(received, 0)
    coords = torch.tensor(rows["coords"].to_numpy(np.int64))
    nbytes = torch.tensor(body.to_numpy())
    codec = run.codec
    rows["planes"] = np.where(received, np.minimum((8 * body) // rows["coords"], codec.planes), -1)
    rows["bits_per_coord"] = np.where(received, 8.0 * body / rows["coords"], 0.0)
    rows["expected_nmse"] = np.where(received, codec.expected_nmse(coords, nbytes).numpy(), 1.0)
    rows["delay_us"] = (rows["t_recv_ns"] - rows["t_sent_ns"]) / 1e3
    rows["nmse"], rows["truth_scale"] = _truth_errors(run, rows)
    rows["status"] = rows["status"].fillna("not_logged")
    rows["trimmed_at"] = trim_locations(run, rows)
    return rows, side


def trim_locations(run: RunData, rows: pd.DataFrame) -> pd.Series:
    """Where each trimmed packet was trimmed: the one port on its possible paths whose
    counters show trims ("switch:port" in a fabric), "ambiguous" where several do, None
    for packets not trimmed or runs without switch counters."""
    out = pd.Series([None] * len(rows), index=rows.index, dtype=object)
    counters = run.counters
    if counters is None or not len(rows):
        return out
    trimming = {p for p, c in counters["ports"].items() if c.get("TRIM_TX_PKTS", 0) > 0}
    prof = run.profile
    # an asymmetric profile (from-tc) remarks by the facing of the port: the DSCP that
    # arrived rules out the ports of the other facing
    by_facing = prof is not None and prof.dscp == "from-tc"
    host_ports = set(run.topology.host_port.values())
    trimmed = rows[rows["trimmed"]]
    for (snd, rcv, dscp), idx in trimmed.groupby(["sender", "receiver", "dscp_recv"], dropna=False).groups.items():
        where = [p for p in run.topology.egress_ports(snd, rcv) if p in trimming]
        if by_facing and dscp == dscp:  # not NaN
            where = [p for p in where if prof.trimmed_dscp("host" if p in host_ports else "network") == dscp]
        out.loc[idx] = where[0] if len(where) == 1 else AMBIGUOUS if where else None
    return out


# -- the checks ---------------------------------------------------------------------------------

def _check(name: str, observers: str, expected, observed, status: str, detail: str) -> dict:
    return {"check": name, "observers": observers, "expected": expected, "observed": observed,
            "status": status, "detail": detail}


def _capture_checks(run: RunData, side: dict) -> tuple[list[dict], dict[str, int]]:
    checks, lost = [], {}
    for host, cap in side["captures"].items():
        stats = run.capture_stats(host)
        if cap is None:
            checks.append(_check(f"capture {host}", "tcpdump", "a capture", "none", NA,
                                 "no capture file (capture.points did not include this host)"))
            continue
        dropped = sum(v.get("dropped_by_kernel", 0) for v in stats.values()) if stats else None
        lost[host] = dropped or 0
        if stats is None:
            checks.append(_check(f"capture {host}", "tcpdump", 0, "unknown", NA,
                                 "tcpdump's statistics were not collected"))
        else:
            checks.append(_check(f"capture {host}", "tcpdump", 0, dropped, AGREE if not dropped else EXPLAINED,
                                 f"{len(cap)} packets read; tcpdump dropped {dropped}"
                                 + ("" if not dropped else ": checks on this capture may disagree by that much")))
    return checks, lost


def _trims_on_port(run: RunData, host: str, cap: pd.DataFrame | None) -> int | None:
    """Background (non-trimlab) packets this host's capture saw remarked by a trim."""
    flows = run.experiment.congestion.background
    if cap is None:
        return None
    if not flows or run.profile is None:
        return 0
    trim_dscps = run.profile.trimmed_dscps()
    ports = {TRAFFIC_PORT + i for i, f in enumerate(flows) if run.experiment.flow_dscp(f) not in trim_dscps}
    sel = (~cap["trimlab"]) & cap["dport"].isin(ports) & cap["dscp"].isin(trim_dscps)
    return int(sel.sum())


def _gradient_drops(run: RunData, ports: list[str]) -> int:
    """Drops on `ports` in the queues a gradient packet can be dropped from: its DSCP's
    class and the trim queue (every queue where the trim queue is dynamic). Drops on the
    control class are the reliable channel's, which it sends again: no gradient is lost."""
    prof, queues = run.profile, run.counters.get("queues", {})
    dscp = run.experiment.transport.dscp
    tc = prof.tc_of(dscp) if prof else dscp >> 3
    trim_queue = prof.queue if prof else 7
    which = None if trim_queue == "dynamic" else {tc, trim_queue}
    return sum(r["DROP_PKTS"] + r["TRIM_DRP_PKTS"] for p in ports for q, r in enumerate(queues.get(p, []))
               if which is None or q in which)


def _repair_checks(run: RunData, host: str, cap_trims: int | None, log_trims: int | None, lost: int) -> list[dict]:
    """The host's receive repair as a fourth observer: every trimmed gradient packet its
    capture saw arrive, it repaired; without one, behind a switch that leaves a trimmed
    packet's lengths stale, the check names why the trims never reached the socket."""
    if run.repairs is None or cap_trims is None:
        return []
    rep = run.repairs.get(host)
    stale = {sw: pl for sw, pl in run.platforms.items() if pl.get("needs_repair")}
    if rep is None:
        if not stale or not cap_trims:
            return []
        got = log_trims or 0
        names = ", ".join(f"{sw} ({pl['name']}: {', '.join(pl['stale'])} stale)" for sw, pl in stale.items())
        return [_check(f"trimmed packets reach the socket ({host})", f"capture {host} · {host} log", cap_trims, got,
                       AGREE if got == cap_trims else DISAGREE,
                       f"{cap_trims - got} trimmed packets reached {host}'s port but not its socket: the switch "
                       f"leaves lengths stale ({names}) and {host} has no receive repair (nic_host_repair: true)")]
    if "error" in rep:
        return [_check(f"capture trims = repaired ({host})", f"capture {host} · repair {host}", cap_trims, "unknown",
                       NA, f"the repair's counters could not be read: {rep['error']}")]
    got, refused = rep["repaired"], rep["refused"]
    status = AGREE if got == cap_trims and not refused else \
        EXPLAINED if not refused and 0 < got - cap_trims <= lost else DISAGREE
    return [_check(f"capture trims = repaired ({host})", f"capture {host} · repair {host}", cap_trims, got, status,
                   f"trimmed gradient packets in the capture vs the receive repair's count on {host}"
                   + (f"; it refused {refused} inconsistent trimlab frames (left for the kernel to drop)"
                      if refused else ""))]


def checks(run: RunData, rows: pd.DataFrame, side: dict) -> list[dict]:
    out, lost = _capture_checks(run, side)
    cfg = run.cfg
    sent = len(rows)
    seen = int(rows["seen_sender"].sum())
    senders_lost = sum(lost.get(w.name, 0) for w in cfg.workers)
    have_sender = any(side["captures"].get(w.name) is not None for w in cfg.workers)
    out.append(_check("sent = sender capture", "workers' metrics · sender captures", sent, seen if have_sender else "-",
                      NA if not have_sender else AGREE if seen == sent else
                      EXPLAINED if sent - seen <= senders_lost else DISAGREE,
                      "every packet the workers sent left their NIC" if seen == sent else
                      f"{sent - seen} sent packets not in the sender captures"))
    t = rows[rows["truth_scale"].notna() & rows["seen_sender"]]
    if len(t):
        same = int(((t["truth_scale"].astype(np.float32) == t["wire_scale"].astype(np.float32))
                    & (t["wire_length"] == t["sent_len"])).sum())
        out.append(_check("truth re-encoding = wire", "truth/ · sender captures", len(t), same,
                          AGREE if same == len(t) else DISAGREE,
                          "re-encoding the saved gradients gives the headers on the wire bit for bit"
                          if same == len(t) else f"{len(t) - same} packets differ from their re-encoding"))
    counters = run.counters
    plog = run.packet_log
    for host in run.receivers:
        mine = rows[rows["receiver"] == host]
        cap = side["captures"].get(host)
        port = run.hosts.get(host, {}).get("port")
        # one switch: the receiver's port saw every trim and drop of its packets; in a
        # fabric they may happen at any hop (the fabric-wide checks below)
        pc = counters["ports"].get(port) if counters and port and not run.fabric else None
        bg = _trims_on_port(run, host, cap)
        cap_trims = int((mine["trimmed"] & mine["seen_receiver"]).sum()) if cap is not None else None
        log_trims = int(mine["log_trimmed"].fillna(0).sum()) if len(plog) else None
        if pc is not None and cap_trims is not None and bg is not None:
            want, got = pc["TRIM_TX_PKTS"], cap_trims + bg
            out.append(_check(f"switch trims = capture ({host})", f"switch {port} · capture {host}", want, got,
                              AGREE if want == got else EXPLAINED if 0 < want - got <= lost.get(host, 0) else DISAGREE,
                              f"TRIM_TX_PKTS on {port}; the capture saw {cap_trims} trimmed gradient packets"
                              + (f" and {bg} trimmed background packets" if bg else "")))
        if pc is not None and log_trims is not None and bg is not None:
            want, got = pc["TRIM_TX_PKTS"] - bg, log_trims
            out.append(_check(f"switch trims = ps log ({host})", f"switch {port} · {host} log", want, got,
                              AGREE if want == got else DISAGREE,
                              "gradient packets the switch trimmed on the receiver's port vs trimmed rows "
                              "the receiver logged" + (f" ({bg} background trims seen in the capture left out)" if bg else "")))
        if cap is not None and len(plog):
            both = mine[mine["seen_receiver"] & mine["logged"]]
            diff = int((both["trimmed"] != both["log_trimmed"].astype(bool)).sum()
                       + (both["recv_len"] != both["log_len"]).sum())
            only_cap = int((mine["seen_receiver"] & ~mine["logged"]).sum())
            only_log = int((~mine["seen_receiver"] & mine["logged"]).sum())
            final = rundir.Final.read(run.path / rundir.AGENTS / host)
            late = sum(final.discarded.get(k, 0) for k in ("late", "unexpected")) if final else 0
            status = AGREE if diff == only_cap == only_log == 0 else \
                EXPLAINED if diff == 0 and only_cap <= late and only_log <= lost.get(host, 0) else DISAGREE
            detail = (f"{len(both)} packets in both agree on length and trim" if diff == 0 else
                      f"{diff} disagreements on length or trim among {len(both)} packets")
            if only_cap:
                detail += f"; {only_cap} captured but not logged ({late} counted late or unexpected by the receiver)"
            if only_log:
                detail += f"; {only_log} logged but not captured (tcpdump dropped {lost.get(host, 0)})"
            out.append(_check(f"capture = ps log ({host})", f"capture {host} · {host} log", len(both) + only_cap + only_log,
                              len(both), status, detail))
        out += _repair_checks(run, host, cap_trims, log_trims, lost.get(host, 0))
        if pc is not None and not run.experiment.congestion.background:
            want = _gradient_drops(run, [port])
            got = int(mine["dropped"].sum())
            out.append(_check(f"switch drops = never received ({host})", f"switch {port} · capture and log {host}",
                              want, got, AGREE if want == got else DISAGREE,
                              "DROP_PKTS + TRIM_DRP_PKTS of the gradient and trim queues on the receiver's port "
                              "vs gradient packets neither its capture nor its log saw"))
    if counters is None:
        out.append(_check("switch counters", "switch", "counters before and after", "none", NA,
                          "this switch target records no counters in the run (virtual switch only)"))
    elif run.fabric:
        out += _fabric_checks(run, rows, side, lost)
    return out


def _fabric_checks(run: RunData, rows: pd.DataFrame, side: dict, lost: dict[str, int]) -> list[dict]:
    """Trims and drops summed over every hop of every switch against what the receivers
    captured and logged, and the trims located per port against that port's counters."""
    counters, out = run.counters, []
    total = {k: sum(c[k] for c in counters["ports"].values()) for k in ("TRIM_TX_PKTS",)}
    mine = rows[rows["receiver"].isin(run.receivers)]
    caps = {h: side["captures"].get(h) for h in run.receivers}
    have_caps = all(c is not None for c in caps.values())
    bg = sum(_trims_on_port(run, h, side["captures"].get(h)) or 0 for h in side["captures"])
    tolerance = sum(lost.get(h, 0) for h in run.receivers)
    if have_caps:
        got = int((mine["trimmed"] & mine["seen_receiver"]).sum()) + bg
        want = total["TRIM_TX_PKTS"]
        out.append(_check("switch trims = captures (every hop)", "every switch port · receivers' captures", want, got,
                          AGREE if want == got else EXPLAINED if 0 < want - got <= tolerance else DISAGREE,
                          f"TRIM_TX_PKTS summed over {len(counters['ports'])} ports of {len(run.manifest.switches)} "
                          f"switches; the receivers captured {got - bg} trimmed gradient packets"
                          + (f" and {bg} trimmed background packets" if bg else "")))
    if len(run.packet_log):
        want, got = total["TRIM_TX_PKTS"] - bg, int(mine["log_trimmed"].fillna(0).sum())
        out.append(_check("switch trims = receivers' logs (every hop)", "every switch port · receivers' logs", want, got,
                          AGREE if want == got else DISAGREE,
                          "gradient packets trimmed anywhere in the fabric vs trimmed rows the receivers logged"))
    if not run.experiment.congestion.background:
        want, got = _gradient_drops(run, list(counters["ports"])), int(mine["dropped"].sum())
        out.append(_check("switch drops = never received (every hop)", "every switch port · captures and logs",
                          want, got, AGREE if want == got else DISAGREE,
                          "DROP_PKTS + TRIM_DRP_PKTS of the gradient and trim queues summed over every port vs "
                          "gradient packets no receiver saw"))
    at = mine["trimmed_at"]
    located = at[at.notna() & (at != AMBIGUOUS)].value_counts()
    over = {p: int(n) for p, n in located.items() if n > counters["ports"].get(p, {}).get("TRIM_TX_PKTS", 0)}
    n_trim, n_amb = int(mine["trimmed"].sum()), int((at == AMBIGUOUS).sum())
    n_loc = int(located.sum())
    ok = not over and n_loc == n_trim - n_amb  # none trimmed where no port on its path trims
    detail = (f"{n_loc} trimmed packets located at one port (" + ", ".join(f"{p} {n}" for p, n in located.items())
              + f"), {n_amb} ambiguous (trims on several ports of their paths)")
    if over:
        detail = f"more packets located at a port than it trimmed: {over}"
    elif not ok:
        detail += f"; {n_trim - n_amb - n_loc} trimmed packets with no trimming port on their path"
    out.append(_check("trims located", "paths · switch counters", n_trim - n_amb, n_loc,
                      AGREE if ok else DISAGREE, detail))
    return out


def gloo_checks(run: RunData) -> list[dict]:
    """A DDP run over gloo has no trimlab packets: its TCP between the workers is counted
    where it left (sender captures), where it arrived (receiver captures) and where the
    switch dropped it (DROP_PKTS of the queue its DSCP maps to, on the workers' ports)."""
    captures = {w.name: run.capture(w.name) for w in run.cfg.workers}
    out, lost = _capture_checks(run, {"captures": captures})
    addrs = {w.name: run.hosts.get(w.name, {}).get("addr") for w in run.cfg.workers}
    peers = set(addrs.values())
    sent = recv = 0
    for name, cap in captures.items():
        if cap is None:
            return out + [_check("gloo sent = received + dropped", "captures · switch", "-", "-", NA,
                                 f"no capture of {name}: capture.points must include the workers")]
        tcp = cap[(cap["proto"] == 6) & cap["src"].isin(peers) & cap["dst"].isin(peers)]
        sent += int((tcp["src"] == addrs[name]).sum())
        recv += int((tcp["dst"] == addrs[name]).sum())
    counters = run.counters
    if counters is None:
        return out + [_check("gloo sent = received + dropped", "captures", sent, recv, AGREE if sent == recv else NA,
                             "no switch counters: packets sent and received only")]
    tc = run.profile.tc_of(0) if run.profile else 0  # gloo's TCP: DSCP 0
    ports = [run.hosts.get(n, {}).get("port") for n in captures]
    drops = sum(counters["queues"][p][tc]["DROP_PKTS"] + counters["queues"][p][tc]["TRIM_DRP_PKTS"]
                for p in ports if p in counters.get("queues", {}))
    background = bool(run.experiment.congestion.background)
    tolerance = sum(lost.values())
    if background:  # the queue also dropped background packets, which no capture saw leave
        ok = 0 <= sent - recv <= drops
        status = AGREE if ok else EXPLAINED if sent - recv - drops <= tolerance else DISAGREE
        detail = (f"{sent - recv} gloo packets never arrived; the switch dropped {drops} packets in queue {tc} "
                  "of the workers' ports (background flows' included)")
        return out + [_check("gloo sent - received ≤ dropped", "sender and receiver captures · switch queues",
                             drops, sent - recv, status, detail)]
    got = recv + drops
    status = AGREE if got == sent else EXPLAINED if abs(sent - got) <= tolerance else DISAGREE
    return out + [_check("gloo sent = received + dropped", "sender and receiver captures · switch queues", sent, got,
                         status, f"TCP between the workers: {sent} left the senders, {recv} arrived, the switch "
                         f"dropped {drops} in queue {tc} of the workers' ports")]


# -- the files ----------------------------------------------------------------------------------

LOAD_TOLERANCE = 0.03  # a background flow offers at least 97 % of the rate it was asked for


def load_checks(run: RunData) -> list[dict]:
    """Each background flow's offered load (its sender's bytes over the time it was on)
    against the rate the spec asked for: a flow that fell short disagrees, saying by how much."""
    out = []
    for i, flow in enumerate(run.experiment.congestion.background):
        got = run.background_load.get(i)
        name = f"offered load = requested (flow {i})"
        if got is None:
            out.append(_check(name, f"traffic{i} log", flow.rate, "none", DISAGREE,
                              f"flow {i} left no summary: its sender did not finish (see logs/*-traffic{i}.log)"))
            continue
        asked, offered = float(got["rate_bps"]), float(got["offered_bps"])
        ok = offered >= (1 - LOAD_TOLERANCE) * asked
        out.append(_check(name, f"traffic{i} sender (bytes over {got['on_s']:.2f} s on)", _mbit(asked), _mbit(offered),
                          AGREE if ok else DISAGREE,
                          f"flow {i} offered {_mbit(offered)} of {_mbit(asked)} Mbit/s "
                          f"({offered / asked:.1%}; tolerance {LOAD_TOLERANCE:.0%})" if asked else "no rate"))
    return out + switch_load_checks(run)


def switch_load_checks(run: RunData) -> list[dict]:
    """A second observer of each traffic host's flows: the payload the switch's port received
    from the host (the only sender there) against the bytes its senders handed the kernel,
    within the same tolerance. TCP may be above (retransmissions), never below."""
    flows = run.experiment.congestion.background
    by_host: dict[str, list[int]] = {}
    for i, got in sorted(run.background_load.items()):
        by_host.setdefault(got["host"], []).append(i)
    out = []
    for host, idx in by_host.items():
        protocols = {flows[i].protocol for i in idx if i < len(flows)}
        at_switch = run.switch_port_payload(host, "udp" if protocols == {"udp"} else "tcp")
        if at_switch is None:
            continue
        sent = sum(run.background_load[i]["bytes"] for i in idx)
        low, high = (1 - LOAD_TOLERANCE) * sent, (1 + LOAD_TOLERANCE) * sent if protocols == {"udp"} else float("inf")
        ok = low <= at_switch <= high
        label = ", ".join(f"flow {i}" for i in idx)
        out.append(_check(f"background bytes = switch port in ({host})", f"switch port {run.hosts[host]['port']} RX",
                          sent, at_switch, AGREE if ok else DISAGREE,
                          f"{label}: senders handed the kernel {sent} bytes, the switch received {at_switch} "
                          f"({at_switch / sent:.1%}; tolerance {LOAD_TOLERANCE:.0%})" if sent else "nothing sent"))
    return out


INJECT_SIGMAS = 5  # injection's share may fall this many binomial standard deviations short of p


def injection_checks(run: RunData) -> list[dict]:
    """Injection at probability p, measured: on the queues it reaches, over every port, the
    packets the switch cut (trimmed or dropped) against all it handled there. Fewer than p
    by more than 5 standard deviations disagrees: an injection that reached no packet (its
    queue left out of the switch's configuration) shows here. More is congestion's share."""
    prof, c = run.profile, run.counters
    if prof is None or c is None or not prof.injection.probability:
        return []
    p = prof.injection.probability
    queues = prof.injection.queues or prof.eligible_queues
    cut = total = 0
    for qs in c["queues"].values():
        for q in queues:
            if q < len(qs):  # a trimmed packet leaves from the trimmed-packet queue: count it here
                cut += qs[q].get("TRIM_PKTS", 0) + qs[q].get("DROP_PKTS", 0)
                total += qs[q].get("TX_PKTS", 0) + qs[q].get("TRIM_PKTS", 0) + qs[q].get("DROP_PKTS", 0)
    name, observers = "injected share = requested", f"switch queues {','.join(map(str, queues))}"
    if not total:
        return [_check(name, observers, f"{p:.4%}", "no packets", DISAGREE,
                       f"no packet went through queue(s) {','.join(map(str, queues))}, the ones injection reaches")]
    share, sigma = cut / total, (p * (1 - p) / total) ** 0.5
    ok = share >= p - INJECT_SIGMAS * sigma
    return [_check(name, observers, f"{p:.4%}", f"{share:.4%}", AGREE if ok else DISAGREE,
                   f"the switch cut {cut} of {total} packets on the queues injection reaches"
                   + ("" if ok else f"; fewer than p = {p:g} allows ({INJECT_SIGMAS} standard deviations)"))]


def pacing_checks(run: RunData) -> list[dict]:
    """The hook's pacing, where it has a rate: each worker's gradient packets as its own
    capture saw them leave, every step's burst from its first packet to its last, against
    the rate asked for (the same 3 % tolerance). A sender that a busy host held back
    (paced in user space, where it can only make up two packets) falls short here."""
    cfg = run.cfg
    rate = cfg.transport.pacing_bps if cfg else None
    if not rate:
        return []
    out = []
    for w in cfg.workers:
        name = f"hook pacing = requested ({w.name})"
        cap = run.capture(w.name)
        if cap is None:
            out.append(_check(name, f"{w.name} capture", _mbit(rate), "none", NA,
                              "no capture of this worker (capture.points did not include it)"))
            continue
        sent = cap[cap["trimlab"] & (cap["src"] == w.addr) & (cap["dport"] == cfg.transport.port)]
        steps = sent.groupby("step", sort=False).agg(first=("ts_ns", "min"), last=("ts_ns", "max"),
                                                     n=("ts_ns", "size"), bytes=("udp_payload", "sum"))
        steps = steps[steps["n"] > 1]
        span_ns = float((steps["last"] - steps["first"]).sum())
        if not span_ns:
            out.append(_check(name, f"{w.name} capture", _mbit(rate), "none", NA, "no step of two packets or more"))
            continue
        # a burst of n packets spans n - 1 gaps: its bytes but one packet's, over the span
        paced = float((steps["bytes"] * (steps["n"] - 1) / steps["n"]).sum()) * 8 / (span_ns / 1e9)
        ok = paced >= (1 - LOAD_TOLERANCE) * rate
        out.append(_check(name, f"{w.name} capture ({len(steps)} steps' bursts)", _mbit(rate), _mbit(paced),
                          AGREE if ok else DISAGREE,
                          f"{w.name} sent its gradients at {_mbit(paced)} of {_mbit(rate)} Mbit/s "
                          f"({paced / rate:.1%}; tolerance {LOAD_TOLERANCE:.0%})"))
    return out


def _mbit(bps: float) -> float:
    return round(bps / 1e6, 2)


def match(run: RunData) -> tuple[pd.DataFrame, list[dict]]:
    wl = run.experiment.workload
    if wl.kind == "ddp" and wl.comm == "gloo":
        return pd.DataFrame(columns=COLUMNS), gloo_checks(run) + load_checks(run) + injection_checks(run)
    rows, side = packet_table(run)
    return rows, checks(run, rows, side) + load_checks(run) + pacing_checks(run) + injection_checks(run)


def write(run_dir: str | Path) -> tuple[pd.DataFrame, list[dict]]:
    run = RunData.open(run_dir)
    rows, chk = match(run)
    rows[COLUMNS].to_parquet(run.path / rundir.PACKETS_TABLE, index=False)
    summary = {"all_agree": all(c["status"] == AGREE for c in chk),
               "disagree": sum(c["status"] == DISAGREE for c in chk), "checks": chk}
    (run.path / rundir.CHECKS).write_text(json.dumps(summary, indent=1, default=_jsonable) + "\n")
    return rows, chk


def _jsonable(v):
    return v.item() if hasattr(v, "item") else str(v)
