"""Packet capture: tcpdump on named interfaces with a snaplen (headers at senders, full
payloads at receivers), rotating files, and a clean stop: on SIGTERM/SIGINT tcpdump gets
SIGINT, flushes, and its packet/drop statistics are written to NAME.capture.json (so an
analysis can tell a capture that lost packets from a disagreement).

    python -m trimlab.agents.capture --iface eth1 --snaplen 128 --out /var/tmp/trimlab/run/w1 --name w1
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from trimlab import rundir

STATS = re.compile(r"(\d+) packets? (captured|received by filter|dropped by kernel|dropped by interface)")


def tcpdump_argv(iface: str, path: Path, snaplen: int, rotate_mb: int, files: int, bpf: str) -> list[str]:
    argv = ["tcpdump", "-i", iface, "-n", "-s", str(snaplen), "-U", "--immediate-mode",
            "-Z", "root", "-w", str(path)]
    if rotate_mb:
        argv += ["-C", str(rotate_mb)]
        if files:
            argv += ["-W", str(files)]
    return argv + (bpf.split() if bpf else [])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.agents.capture", description=__doc__.split("\n\n")[0])
    ap.add_argument("--iface", action="append", required=True, help="interface (repeat for several)")
    ap.add_argument("--snaplen", type=int, default=0, help="bytes kept per packet (0: all)")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--name", required=True, help="file prefix: NAME[-IFACE].pcap")
    ap.add_argument("--rotate-mb", type=int, default=256, help="start a new file every N MB (0: never)")
    ap.add_argument("--files", type=int, default=0, help="keep only the last N files (0: all)")
    ap.add_argument("--filter", default="", help="a pcap filter expression")
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    procs, listening = {}, {}
    for iface in a.iface:
        stem = a.name if len(a.iface) == 1 else f"{a.name}-{iface}"
        p = subprocess.Popen(tcpdump_argv(iface, a.out / rundir.pcap_file(stem), a.snaplen, a.rotate_mb,
                                          a.files, a.filter),
                             stderr=subprocess.PIPE, text=True)
        procs[iface], listening[iface] = p, threading.Event()
    stderr: dict[str, list[str]] = {i: [] for i in procs}

    def read(iface: str) -> None:
        for line in procs[iface].stderr:
            stderr[iface].append(line.rstrip())
            if "listening on" in line:
                listening[iface].set()

    threads = [threading.Thread(target=read, args=(i,), daemon=True) for i in procs]
    for t in threads:
        t.start()
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    for iface, ev in listening.items():
        while not ev.wait(0.1):
            if procs[iface].poll() is not None or stop.is_set():
                break
    failed = {i: p.poll() for i, p in procs.items() if p.poll() is not None}
    if not failed:
        print(json.dumps({"event": "listening", "ifaces": a.iface}), flush=True)
        while not stop.wait(0.2):
            failed = {i: p.poll() for i, p in procs.items() if p.poll() is not None}
            if failed:
                break
    for p in procs.values():
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs.values():
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    for t in threads:
        t.join(2)
    stats = {}
    for iface, lines in stderr.items():
        s = {m.group(2).replace(" ", "_"): int(m.group(1)) for line in lines for m in STATS.finditer(line)}
        stats[iface] = {**s, "rc": procs[iface].returncode}
    (a.out / rundir.capture_stats_file(a.name)).write_text(json.dumps(stats, indent=2) + "\n")
    print(json.dumps({"event": "stopped", "stats": stats}), flush=True)
    if failed:
        for iface, rc in failed.items():
            print(f"capture: tcpdump on {iface} exited {rc}: {' / '.join(stderr[iface][-2:])}",
                  file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
