"""A synthetic run directory with known trims and drops: real trimlab packets (the run's
codec, seed and layout) written as pcaps the way tcpdump would see them at the senders and
at the ps, the ps's packet log, switch counters, truth, metrics. Knobs inject the
discrepancies the checks must report."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw
from scapy.utils import PcapWriter

from trimlab import rundir, wire
from trimlab.codec import CodecContext, get_codec
from trimlab.config import GRADIENT_PORT, METRIC_FIELDS, PACKET_LOG_FIELDS, PHASES

T0 = 1_790_000_000.0
PS = {"name": "s-ps1", "addr": "198.19.0.14", "port": "Ethernet8"}
WORKERS = [{"name": f"s-w{i + 1}", "addr": f"198.19.0.{10 + i}", "port": f"Ethernet{4 * i}"} for i in range(2)]
COUNTERS = ("TX_PKTS", "TX_BYTES", "TRIM_PKTS", "TRIM_TX_PKTS", "TRIM_DRP_PKTS", "DROP_PKTS")


@dataclass
class Synth:
    steps: int = 4
    numel: int = 3000
    codec: str = "embedded"
    coords: int = 480
    trims: dict = field(default_factory=dict)  # (step, rank, span, packet) -> body bytes kept
    drops: set = field(default_factory=set)  # (step, rank, span, packet)
    switch_trim_error: int = 0  # added to the switch's TRIM_TX_PKTS
    unlogged: set = field(default_factory=set)  # reached the ps's NIC, not its log
    uncaptured: set = field(default_factory=set)  # logged, not in the ps's capture
    tcpdump_dropped: int = 0
    late: int = 0  # the ps's own count of late packets
    corrupt_scale: tuple | None = None  # a sender-capture header whose scale is wrong
    pacing_bps: int | None = None  # the hook's pacing asked for (its packets leave 100 µs apart)

    def cfg(self) -> dict:
        return {"name": "synth", "job": 1, "seed": 7, "steps": self.steps, "mtu": 1500, "topology": "ps",
                "workload": {"kind": "digits", "steps": self.steps},
                "codec": {"name": self.codec, "params": get_codec(self.codec).params(), "span": 4096,
                          "coords": self.coords},
                "transport": {"dscp": 10, "control_dscp": 46, "deadline_ms": 200, "pacing_bps": self.pacing_bps,
                              "port": GRADIENT_PORT, "ipv6": False},
                "truth_every": 2, "eval_every": 2, "ps": {"name": PS["name"], "addr": PS["addr"]},
                "workers": [{"name": w["name"], "addr": w["addr"]} for w in WORKERS]}

    def gradient(self, step: int, rank: int) -> torch.Tensor:
        return torch.randn(self.numel, generator=torch.Generator().manual_seed(1000 * step + rank))

    def write(self, path: Path) -> Path:
        cfg = self.cfg()
        for sub in ("pcaps", "switch", "truth", "logs"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        codec = get_codec(self.codec)
        (path / "agent.json").write_text(json.dumps(cfg))
        spec = {"name": "synth", "codec": {"name": self.codec}, "topology": "ps", "congestion": {},
                "workload": {"steps": self.steps}}
        hosts = {h["name"]: {"role": "ps" if h is PS else "worker", "data_if": "eth1", "data_ipv4": h["addr"],
                             "switch_port": h["port"], "ansible_host": f"198.18.0.{20 + i}"}
                 for i, h in enumerate([*WORKERS, PS])}
        facts = {n: {k: v[k] for k in ("role", "data_ipv4", "switch_port")} for n, v in hosts.items()}
        (path / rundir.MANIFEST).write_text(rundir.Manifest(
            schema_version=rundir.SCHEMA_VERSION, name=path.name, status="succeeded", started="2026-12-04T01:02:03+00:00",
            spec=spec, hosts=facts,
            results={"test_acc": 0.5 + 0.1 * (self.steps - 1), "wall_s": 3.0, "parameters_identical": True},
        ).model_dump_json())
        ports = {h["port"]: {"host": h["name"], "facing": "host", "speed_mbps": 100} for h in [*WORKERS, PS]}
        inv = {"all": {"vars": {}, "children": {
            "trim_switches": {"hosts": {"s-sw": {"trim_switch_os": "vswitch", "ports": ports,
                                                         "ansible_host": "198.18.0.2"}}},
            "nic_hosts": {"hosts": hosts}}}}
        (path / "inventory.yml").write_text(yaml.safe_dump(inv))
        (path / "switch" / "default.yml").write_text(yaml.safe_dump({"name": "default", "size": 128, "dscp": 48}))
        rx = PcapWriter(str(path / "pcaps" / f"{PS['name']}.pcap"), linktype=1)
        log_rows, t = [], T0
        trims = drops = 0
        for rank, w in enumerate(WORKERS):
            out = path / "agents" / w["name"]
            out.mkdir(parents=True, exist_ok=True)
            rundir.GradientLayout(numel=self.numel, rank=rank, topology="ps", buckets={0: (0, self.numel)}).write(out)
            tx = PcapWriter(str(path / "pcaps" / f"{w['name']}.pcap"), linktype=1)
            with open(out / "metrics.csv", "w", newline="") as f:
                mw = csv.writer(f)
                mw.writerow(METRIC_FIELDS)
                for step in range(self.steps):
                    g = self.gradient(step, rank)
                    if step % 2 == 0:
                        np.save(path / rundir.TRUTH / rundir.truth_file(step, rank), g.numpy())
                    ctx = CodecContext(seed=7, step=step, bucket=0, span=4096, coords=self.coords)
                    pk = codec.encode(g, ctx)
                    payloads = wire.packetize(g, codec, 1500, self.coords, 4096, wire.PacketIds(1, step, rank, 0), 7)
                    for p, s, i in zip(payloads, pk.span.tolist(), pk.index.tolist()):
                        key = (step, rank, s, i)
                        t += 0.0001
                        sent = p
                        if self.corrupt_scale == key:
                            sent = p[:20] + bytes(4) + p[24:]
                        frame = Ether() / IP(src=w["addr"], dst=PS["addr"], tos=10 << 2) / UDP(sport=40000, dport=47000)
                        pkt = frame / Raw(sent)
                        pkt.time = t
                        tx.write(pkt)
                        if key in self.drops:
                            drops += 1
                            continue
                        got, dscp = p, 10
                        if key in self.trims:
                            got, dscp = p[:wire.HEADER_LEN + self.trims[key]], 48
                            trims += 1
                        r = Ether() / IP(src=w["addr"], dst=PS["addr"], tos=dscp << 2) / UDP(sport=40000, dport=47000) / Raw(got)
                        r.time = t + 0.00005
                        if key not in self.uncaptured:
                            rx.write(r)
                        if key not in self.unlogged:
                            body = len(got) - wire.HEADER_LEN
                            planes = min(8 * body // _coords(pk, s, i), codec.planes)
                            log_rows.append([int(r.time * 1e9), w["addr"], dscp, step, rank, 0, s, i,
                                             _coords(pk, s, i), len(p), len(got), int(len(got) < len(p)),
                                             planes, "accepted"])
                    mw.writerow([step, 0.1 * step, 2.0 / (step + 1), 1.0, len(payloads), sum(map(len, payloads)),
                                 *range(1, 1 + len(PHASES))])
            tx.close()
            (path / "pcaps" / f"{w['name']}.capture.json").write_text(json.dumps(
                {"eth1": {"captured": 1, "received_by_filter": 1, "dropped_by_kernel": 0, "rc": 0}}))
        rx.close()
        (path / "pcaps" / f"{PS['name']}.capture.json").write_text(json.dumps(
            {"eth1": {"captured": 1, "received_by_filter": 1, "dropped_by_kernel": self.tcpdump_dropped, "rc": 0}}))
        ps = path / "agents" / PS["name"]
        ps.mkdir(parents=True, exist_ok=True)
        with open(ps / "packets.csv", "w", newline="") as f:
            cw = csv.writer(f)
            cw.writerow(PACKET_LOG_FIELDS)
            cw.writerows(log_rows)
        rundir.Final(role="ps", checksum="0" * 16, discarded={"late": self.late}).write(ps)
        with open(ps / "steps.csv", "w", newline="") as f:
            sw = csv.writer(f)
            sw.writerow(["step", "t", "test_acc"])
            for step in range(self.steps):
                sw.writerow([step, 0.1 * step, 0.5 + 0.1 * step])
        with open(path / "switch" / "occupancy.csv", "w", newline="") as f:  # 10 ms samples of the ps's port
            ow = csv.writer(f)
            ow.writerow(["time_s", "port", "queue", "OCCUPANCY", "PEAK_OCCUPANCY", *COUNTERS])
            for k in range(50):
                occ = 4000 + 4000 * (k % 10 >= 5)
                ow.writerow([T0 + 0.01 * k, PS["port"], 1, occ, 8000, 10 * k, 9840 * k, k // 10, k // 10, 0, 0])
        (path / "logs" / "s-tr1-traffic0.log").write_text("".join(
            json.dumps({"t": T0 + 0.1 * k, "event": "on" if k % 2 == 0 else "off"}) + "\n" for k in range(4)))
        zero = {k: 0 for k in COUNTERS}
        after_ps = zero | {"TRIM_PKTS": trims, "TRIM_TX_PKTS": trims + self.switch_trim_error, "DROP_PKTS": drops}
        for name, ps_counters in (("before", zero), ("after", after_ps)):
            ports = {h["port"]: (ps_counters if h is PS else zero) for h in [*WORKERS, PS]}
            # as the virtual switch counts them: per queue, the ports' sums (all in the gradients' queue 1)
            doc = {"switch": ps_counters, "ports": ports,
                   "queues": {p: [c if q == 1 else zero for q in range(8)] for p, c in ports.items()}}
            (path / "switch" / f"counters_{name}.json").write_text(json.dumps(doc))
        return path


def _coords(pk, span: int, index: int) -> int:
    rows = ((pk.span == span) & (pk.index == index)).nonzero()
    return int(pk.coords[rows[0, 0]])
