"""`trimlab bench switch`: packets per second through the virtual switch with and without
the trimming program, and with every packet trimmed, on one rack in the same run.

A C load generator (sendmmsg) on w1 sends to ps1, which counts what its NIC received; the
port rate is set far above what the machine can push, so the limiter never binds and the
figures measure the datapath's cost. The three configurations run one after another in
each round; the ratios are medians of per-round ratios, so a slow spell of this shared
machine hits the points it compares alike and cancels."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path

from trimlab import native, resources, rundir
from trimlab.testbed.vrack import rack, vswitch

SOURCE = resources.c_source("bench", "blast.c")


def _blaster() -> Path:
    return native.build(SOURCE, "gcc", ["-O2"], "blast")


def _rx_packets(ns: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/sys/class/net/eth1/statistics/rx_packets"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def run(quick: bool = False, rack_id: str = "bsw") -> dict:
    seconds, rounds = (0.5, 5) if quick else (1.0, 11)
    st = rack.up(rack.plan(rack_id, 1, 1, 0, "100gbit", 1500, 0), owned=True)
    sinks: list[subprocess.Popen] = []
    try:
        sw = st.vswitch()
        w1, ps = st.nic_hosts[0], st.nic_hosts[1]
        big = {"BUFFER_PROFILE": {"deep": {"static_th": str(1 << 30), "packet_discard_action": "trim"}},
               "BUFFER_QUEUE": {f"{','.join(st.ports)}|0-7": {"profile": "deep"}},
               "SWITCH_TRIMMING": {"GLOBAL": {"size": "128"}}}
        sw.apply(big)
        # A socket that never reads: the receiver's stack drops at its queue, no ICMP.
        rundir.spawn(sinks, ["ip", "netns", "exec", ps.ns, sys.executable, "-c",
                             "import socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
                             "s.bind(('0.0.0.0', 47001)); time.sleep(3600)"])
        exe = _blaster()
        ports = [(h.port, h.port_index) for h in st.nic_hosts]

        def configure(mode: str) -> None:
            for port, _ in ports:
                subprocess.run(["nsenter", f"--net=/run/netns/{st.switch.ns}", "tc", "filter", "del",
                                "dev", port, "egress"], capture_output=True)
            if mode != "no_program":
                for h in st.nic_hosts:
                    vswitch.attach_program(st.switch.ns, h.port, st.pin_dir)
            p = "1" if mode == "all_trimmed" else "0"
            sw.apply({"TRIMLAB_INJECT": {"GLOBAL": {"probability": p, "action": "trim"}}})

        pps: dict[str, list[float]] = {"no_program": [], "program": [], "all_trimmed": []}
        for _ in range(rounds):
            for mode in pps:
                configure(mode)
                before = _rx_packets(ps.ns)
                t0 = time.monotonic()
                subprocess.run(["ip", "netns", "exec", w1.ns, str(exe), ps.data_ipv4, "47001", "512",
                                str(10 << 2), str(seconds)], capture_output=True, check=True)
                time.sleep(0.05)
                pps[mode].append((_rx_packets(ps.ns) - before) / (time.monotonic() - t0 - 0.05))
        trims = sw.counters()["switch"]["TRIM_TX_PKTS"]
    finally:
        for sink in sinks:
            sink.kill()
            sink.wait()
        rack.down(st)
    med = {k: statistics.median(v) for k, v in pps.items()}
    # Ratios within each round, then their median: a slow spell of the machine hits the
    # three points of a round alike, and cancels.
    fwd = statistics.median(p / n for p, n in zip(pps["program"], pps["no_program"]))
    trim = statistics.median(t / p for t, p in zip(pps["all_trimmed"], pps["program"]))
    return {"bench": "switch", "quick": quick, "seconds_per_point": seconds, "rounds": rounds,
            "payload_bytes": 512, "trim_size": 128,
            "pps_median": {k: round(v) for k, v in med.items()},
            "pps_all": {k: [round(x) for x in v] for k, v in pps.items()},
            "forwarding_ratio": round(fwd, 3),
            "trim_pps_ratio": round(trim, 3),
            "trimmed_packets_seen": trims,
            "targets": {"forwarding_ratio_ge_0.9": fwd >= 0.9, "trim_pps_ratio_ge_0.8": trim >= 0.8}}
