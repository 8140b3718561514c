"""Background traffic: a UDP or TCP flow at a rate, with a DSCP, constant or on/off, and
the sink that receives it. Every on/off transition is printed as a JSON line (the report
marks the flows on the time axis); a summary line is printed when the flow stops.

    python -m trimlab.agents.traffic sink --bind 198.19.0.14 --port 48000 --protocol udp
    python -m trimlab.agents.traffic send --dst 198.19.0.14 --port 48000 --rate 300mbit --dscp 10 \\
        --pattern on_off --on-ms 50 --off-ms 50
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import sys
import time

import numpy as np

from trimlab import wire
from trimlab.agents.transport import (
    BUFFER_BYTES,
    Pacer,
    Sender,
    family,
    kernel_pacing,
    set_tos,
    unsent_bytes,
)
from trimlab.config import TRAFFIC_PORT, parse_rate


def _event(**fields) -> None:
    print(json.dumps({"t": time.time(), **fields}), flush=True)


class _Stop(Exception):
    pass


def _on_signal(*_):
    raise _Stop


FQ_FLOW_PACKETS = 90  # fq queues at most 100 packets a flow (flow_limit) and drops the rest


def _burst(rate_bps: float, size: int, paced_by: str | None) -> int:
    """How far behind its schedule a background flow may catch up (two datagrams at
    least). Shaped in an htb class of its own, a catch-up waits there and leaves at the
    rate, so it may cover 250 ms of oversleeping: once the sender has fallen behind once,
    that backlog keeps the wire busy through later stalls. Under fq the same holds up to
    fq's per-flow queue. Paced in user space alone, a catch-up leaves back to back, so it
    is held to 20 ms."""
    if paced_by is None:
        return max(2 * size, int(rate_bps * 0.02 / 8))
    held = int(rate_bps * 0.25 / 8)
    return max(2 * size, held if paced_by.startswith("htb") else min(held, FQ_FLOW_PACKETS * size))


def _batch(rate_bps: float, size: int) -> int:
    """Datagrams a shaped flow hands the kernel per wake-up: 1 ms of its rate (at most 64),
    so a fast flow is not held back by one system call per datagram."""
    return max(1, min(64, int(rate_bps * 1e-3 / 8 / size)))


def send(a) -> dict:
    if a.nice:
        os.setpriority(os.PRIO_PROCESS, 0, a.nice)
    rate = parse_rate(a.rate)
    payload = b"\0" * a.size
    sent = 0
    if a.protocol == "udp":
        tx = Sender(a.dst, a.port, a.dscp)
        sock = tx.sock
    else:
        sock = socket.socket(family(a.dst), socket.SOCK_STREAM)
        set_tos(sock, a.dscp)
        sock.connect((a.dst, a.port))
    # the kernel counts frames, the request is payload: Ethernet, IP and UDP (TCP: and its
    # options, per MSS-sized segment) headers on top of each datagram or segment
    if a.protocol == "udp":
        frame = a.size + wire.ip_udp_overhead(":" in a.dst) + wire.ETH_LEN
        per = a.size
    else:
        per = max(1, sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) or 1448)
        frame = per + (40 if ":" in a.dst else 20) + 32 + wire.ETH_LEN
    paced_by, shaped = kernel_pacing(sock, a.dst, rate, minor=a.port, frame_over_payload=frame / per,
                                     htb=a.kernel_shaping)
    pacer = Pacer(rate, _burst(rate, a.size, paced_by))
    if a.protocol == "udp" and shaped:
        k = _batch(rate, a.size)
        batch = wire.Frames(np.zeros((k, a.size), dtype=np.uint8), np.full(k, a.size, dtype=np.int64))

        def emit() -> int:  # the class spaces them on the wire
            pacer.wait(k * a.size)
            tx.send_frames(batch, one_per_message=True)
            return k * a.size
    elif a.protocol == "udp":
        def emit() -> int:
            pacer.wait(len(payload))
            tx.send(payload)
            return len(payload)
    else:
        def emit() -> int:  # pace the application writes; TCP does the rest
            pacer.wait(len(payload))
            sock.sendall(payload)
            return len(payload)
    end = time.monotonic() + a.duration if a.duration else float("inf")
    on = True
    on_at = time.monotonic()
    on_s = 0.0  # the time the flow was on: what its rate is measured over
    phase_end = on_at + (a.on_ms / 1e3 if a.pattern == "on_off" else float("inf"))
    _event(event="on", rate_bps=rate, dscp=a.dscp, protocol=a.protocol)
    try:
        try:
            while time.monotonic() < end:
                now = time.monotonic()
                if now >= phase_end:
                    on = not on
                    phase_end = now + (a.on_ms if on else a.off_ms) / 1e3
                    if on:  # the off phase was asked for: no deficit to make up
                        on_at = now
                        pacer.restart()
                    else:
                        on_s += now - on_at
                    _event(event="on" if on else "off")
                if on:
                    sent += emit()
                else:
                    time.sleep(min(0.005, max(0.0, phase_end - now)))
        except (_Stop, BrokenPipeError, ConnectionResetError):
            pass
        if on:
            on_s += time.monotonic() - on_at
        _event(event="off")
        queued = unsent_bytes(sock)  # handed to the kernel, not on the wire yet: not offered
    finally:
        if shaped:  # its backlog leaves first (at most the burst bound): a class goes with its packets
            try:
                shaped.drain(sock, 2 * _burst(rate, a.size, paced_by), rate)
            except _Stop:  # signalled again: stop waiting, but still remove the class
                pass
            shaped.close()
    offered = max(0, sent - queued)
    return {"event": "summary", "role": "send", "bytes": sent, "queued_bytes": queued, "on_s": round(on_s, 6),
            "rate_bps": rate, "offered_bps": round(offered * 8 / on_s) if on_s > 0 else 0,
            "paced_by": paced_by or "user space"}


def sink(a) -> dict:
    got = packets = 0  # payload bytes; datagrams (UDP) or reads (TCP)
    if a.protocol == "udp":
        s = socket.socket(family(a.bind), socket.SOCK_DGRAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, BUFFER_BYTES)
        s.bind((a.bind, a.port))
        conns = [s]
    else:
        s = socket.socket(family(a.bind), socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((a.bind, a.port))
        s.listen(8)
        conns = [s]
    _event(event="listening", port=a.port, protocol=a.protocol)
    try:
        while True:
            for c in select.select(conns, [], [], 0.5)[0]:
                if a.protocol == "tcp" and c is s:
                    conns.append(s.accept()[0])
                    continue
                data = c.recv(1 << 16)
                if not data and a.protocol == "tcp":
                    conns.remove(c)
                    c.close()
                got += len(data)
                packets += bool(data)
    except _Stop:
        pass
    return {"event": "summary", "role": "sink", "bytes": got, "packets": packets}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.agents.traffic", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("send", help="send one background flow")
    s.add_argument("--dst", required=True)
    s.add_argument("--port", type=int, default=TRAFFIC_PORT)
    s.add_argument("--rate", required=True, help="e.g. 300mbit")
    s.add_argument("--dscp", type=int, default=0)
    s.add_argument("--protocol", choices=("udp", "tcp"), default="udp")
    s.add_argument("--pattern", choices=("constant", "on_off"), default="constant")
    s.add_argument("--on-ms", type=float, default=100.0)
    s.add_argument("--off-ms", type=float, default=100.0)
    s.add_argument("--size", type=int, default=1400, help="bytes per datagram / write")
    s.add_argument("--duration", type=float, default=None, help="seconds (default: until signalled)")
    s.add_argument("--kernel-shaping", action="store_true",
                   help="shape the flow in an htb class of its own under the host NIC's class 1:1 (the "
                        "virtual rack's hosts; needs CAP_NET_ADMIN); fq on the route's device is used anyway")
    s.add_argument("--nice", type=int, default=0,
                   help="scheduling priority to run at (-20: highest; needs root): a host whose cores are "
                        "shared with trainers (the virtual rack's) must not slow the flow")
    k = sub.add_parser("sink", help="receive and discard flows")
    k.add_argument("--bind", default="0.0.0.0")
    k.add_argument("--port", type=int, default=TRAFFIC_PORT)
    k.add_argument("--protocol", choices=("udp", "tcp"), default="udp")
    a = ap.parse_args(argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _on_signal)
    summary = send(a) if a.cmd == "send" else sink(a)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
