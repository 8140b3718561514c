"""`trimlab bench pcap`: packets per second of trimlab.analysis.pcap.read on a capture shaped like
a ps's receiver capture (gradient packets from four workers, a sixth of them trimmed and
remarked, parameter chunks and ACKs on the control port), against dpkt building the same
table and `tshark -T fields` printing the same fields, on the same file in the same run."""

from __future__ import annotations

import shutil
import statistics
import struct
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scapy.layers.inet import IP, UDP
from scapy.layers.l2 import Ether
from scapy.packet import Raw

from trimlab import wire
from trimlab.analysis import pcap
from trimlab.codec import get_codec
from trimlab.config import GRADIENT_PORT

FIELDS = ("ts_ns", "caplen", "wirelen", "dscp", "src", "dst", "sport", "dport", "udp_len")


def frames(seed: int = 0) -> list[bytes]:
    """A pool of distinct frames: real trimlab packets (some trimmed) and control packets."""
    codec = get_codec("embedded", planes=16)
    g = torch.Generator().manual_seed(seed)
    out = []
    for step in range(4):
        for rank in range(4):
            payloads = wire.packetize(torch.randn(20_000, generator=g), codec, coords=480,
                                      ids=wire.PacketIds(1, step, rank, 0), seed=seed)
            for i, p in enumerate(payloads):
                trimmed = i % 6 == 5
                ip = IP(src=f"198.19.0.{10 + rank}", dst="198.19.0.14", tos=(8 if trimmed else 10) << 2)
                frame = bytes(Ether() / ip / UDP(sport=GRADIENT_PORT, dport=GRADIENT_PORT) / Raw(p))
                out.append(frame[:128] if trimmed else frame)
            ctrl = IP(src="198.19.0.14", dst=f"198.19.0.{10 + rank}", tos=46 << 2)
            out.append(bytes(Ether() / ctrl / UDP(sport=47001, dport=47001) / Raw(bytes(1400))))
            out.append(bytes(Ether() / IP(src=ctrl.dst, dst=ctrl.src, tos=46 << 2)
                             / UDP(sport=47001, dport=47001) / Raw(bytes(40))))
    return out


def write_capture(path: Path, packets: int, seed: int = 0) -> int:
    """A pcap (µs timestamps, as tcpdump writes by default) of `packets` records cycling
    through the frame pool."""
    pool = frames(seed)
    rec = struct.Struct("<IIII")
    t0 = 1_790_000_000 * 10 ** 6
    with open(path, "wb") as f:
        f.write(struct.pack("<IHHiIII", 0xA1B2C3D4, 2, 4, 0, 0, 65535, 1))
        parts = []
        for i in range(packets):
            fr = pool[i % len(pool)]
            t = t0 + i * 7
            parts.append(rec.pack(t // 10 ** 6, t % 10 ** 6, len(fr), len(fr)))
            parts.append(fr)
            if len(parts) >= 200_000:
                f.write(b"".join(parts))
                parts = []
        f.write(b"".join(parts))
    return path.stat().st_size


def read_trimlab(path: Path):
    return pcap.read(path)


def read_dpkt(path: Path):
    """The same table with dpkt: one Python object per layer per packet."""
    import dpkt  # a [dev] baseline only, not a dependency of trimlab
    cols = {k: [] for k in FIELDS + tuple(n for n, _ in wire.HEADER_FIELDS)}
    head = struct.Struct("!BBBBHIHHHHHf")
    names = [n for n, _ in wire.HEADER_FIELDS]
    with open(path, "rb") as f:
        for ts, buf in dpkt.pcap.Reader(f):
            eth = dpkt.ethernet.Ethernet(buf)
            ip = eth.data
            if not isinstance(ip, dpkt.ip.IP):
                continue
            udp = ip.data
            row = [round(ts * 1e6) * 1000, len(buf), len(buf), ip.tos >> 2, dpkt.utils.inet_to_str(ip.src),
                   dpkt.utils.inet_to_str(ip.dst), udp.sport, udp.dport, udp.ulen]
            for k, v in zip(FIELDS, row):
                cols[k].append(v)
            data = bytes(udp.data)
            if udp.dport == GRADIENT_PORT and len(data) >= wire.HEADER_LEN:
                mv, cf, planes, pkt, job, step, rank, bucket, span, coords, length, scale = \
                    head.unpack_from(data)
                vals = [mv >> 4, mv & 15, cf >> 4, cf & 15, planes, pkt, job, step, rank, bucket,
                        span, coords, length, scale]
            else:
                vals = [-1] * len(names)
            for k, v in zip(names, vals):
                cols[k].append(v)
    return pd.DataFrame({k: np.asarray(v) for k, v in cols.items()})


def read_tshark(path: Path) -> int:
    """`tshark -T fields` with the same fields; returns the rows printed."""
    fields = ["frame.time_epoch", "frame.cap_len", "frame.len", "ip.dsfield.dscp", "ip.src",
              "ip.dst", "udp.srcport", "udp.dstport", "udp.length", "udp.payload"]
    cmd = ["tshark", "-n", "-r", str(path), "-T", "fields"] + [a for f in fields for a in ("-e", f)]
    out = subprocess.run(cmd, capture_output=True, check=True)
    return out.stdout.count(b"\n")


def _time(fn, *args) -> tuple[float, object]:
    t0 = time.perf_counter()
    r = fn(*args)
    return time.perf_counter() - t0, r


def run(quick: bool = False, packets: int | None = None, reps: int | None = None) -> dict:
    packets = packets or (50_000 if quick else 1_000_000)
    reps = reps or (3 if quick else 5)
    tmp = Path(tempfile.mkdtemp(prefix="trimlab-bench-pcap-"))
    try:
        path = tmp / "rx.pcap"
        size = write_capture(path, packets)
        read_trimlab(path)  # compile the walker and warm the page cache
        ours = []
        for _ in range(reps):
            s, df = _time(read_trimlab, path)
            ours.append(s)
        assert len(df) == packets
        t_ours = statistics.median(ours)
        result = {"bench": "pcap", "quick": quick, "packets": packets, "file_mb": round(size / 1e6, 1),
                  "reps": reps, "seconds": round(t_ours, 3), "packets_per_s": round(packets / t_ours)}
        s, dd = _time(read_dpkt, path)
        assert len(dd) == packets and (dd["dport"].to_numpy() == df["dport"].to_numpy()).all()
        result["dpkt"] = {"seconds": round(s, 3), "packets_per_s": round(packets / s),
                          "ratio": round(s / t_ours, 2)}
        if shutil.which("tshark"):
            s, rows = _time(read_tshark, path)
            assert rows == packets
            result["tshark"] = {"seconds": round(s, 3), "packets_per_s": round(packets / s),
                                "ratio": round(s / t_ours, 2)}
        else:
            result["tshark"] = None
        result["targets"] = {"packets_per_s_ge_1M": result["packets_per_s"] >= 1_000_000,
                             "dpkt_ratio_ge_20": result["dpkt"]["ratio"] >= 20}
        return result
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
