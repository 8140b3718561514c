"""UDP transport for gradient packets, IPv4 or IPv6: DSCP (and ECN) marking on send, the
TOS/traffic class each packet arrived with on receive (IP_RECVTOS / IPV6_RECVTCLASS),
large socket buffers, batched non-blocking receive, optional pacing to a rate. The command
line numbers its datagrams, to check marking and loss by hand.

    python -m trimlab.agents.transport send --dst 198.19.0.12 --dscp 10 --count 100 --size 1000
    python -m trimlab.agents.transport recv --port 47000 --idle 1
"""

from __future__ import annotations

import argparse
import errno
import json
import select
import fcntl
import socket
import struct
import termios
import sys
import time
from dataclasses import dataclass

from trimlab.config import GRADIENT_PORT

BUFFER_BYTES = 32 << 20
UDP_SEGMENT = 103  # linux/udp.h: a send's segment size (UDP GSO), as SOL_UDP ancillary data
GSO_MAX_SEGMENTS = 64  # linux/udp.h: UDP_MAX_SEGMENTS
GSO_MAX_BYTES = 65000  # the whole send stays one IP datagram
_SEQ = struct.Struct("!I")  # the command line's datagram numbers


def family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def tos_byte(dscp: int, ecn: int = 0) -> int:
    if not (0 <= dscp <= 63 and 0 <= ecn <= 3):
        raise ValueError(f"dscp={dscp} (0..63), ecn={ecn} (0..3)")
    return (dscp << 2) | ecn


def set_tos(sock: socket.socket, dscp: int, ecn: int = 0) -> None:
    """Mark everything `sock` sends with this DSCP (and ECN codepoint)."""
    tos = tos_byte(dscp, ecn)
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)


def _set_buffers(s: socket.socket, opt: int, size: int) -> int:
    """Ask for `size` bytes; the kernel caps it at net.core.[rw]mem_max. Returns what it gave."""
    s.setsockopt(socket.SOL_SOCKET, opt, size)
    return s.getsockopt(socket.SOL_SOCKET, opt)


class Sender:
    """Sends datagrams to one destination with a fixed DSCP, optionally paced to rate_bps
    (a token bucket over UDP payload bytes, so bursts never exceed one packet).

    Unpaced, `send_all` hands runs of equal-size datagrams (the last may be shorter) to the
    kernel as one UDP GSO send each (up to 64): one system call per run, and every segment
    still a datagram of its own with its own trimlab header. The kernel segments in
    software before a device without UDP segmentation offload (the virtual rack's hosts),
    and lab NICs segment in hardware, so the switch never sees a super-packet."""

    def __init__(self, dst: str, port: int = GRADIENT_PORT, dscp: int = 0, ecn: int = 0,
                 rate_bps: float | None = None, sndbuf: int = BUFFER_BYTES, bind: str | None = None):
        self.dst = (dst, port)
        self.sock = socket.socket(family(dst), socket.SOCK_DGRAM)
        if bind:  # send from this address: receivers accept only known sources
            self.sock.bind((bind, 0))
        set_tos(self.sock, dscp, ecn)
        self.sndbuf = _set_buffers(self.sock, socket.SO_SNDBUF, sndbuf)
        self.rate_bps = rate_bps
        self.gso = True  # until the kernel says it cannot
        self._next = time.perf_counter()
        self.sent = 0
        self.bytes = 0

    def send(self, payload: bytes) -> None:
        if self.rate_bps:
            now = time.perf_counter()
            if self._next > now:
                time.sleep(self._next - now)
            self._next = max(self._next, now) + len(payload) * 8 / self.rate_bps
        self.sock.sendto(payload, self.dst)
        self.sent += 1
        self.bytes += len(payload)

    def send_all(self, payloads) -> None:
        if self.rate_bps or not self.gso:
            for p in payloads:
                self.send(p)
            return
        run: list[bytes] = []
        size = 0
        for p in payloads:
            if run and (len(p) > size or len(run) == GSO_MAX_SEGMENTS or (len(run) + 1) * size > GSO_MAX_BYTES):
                self._send_run(run, size)
                run = []
            if not run:
                size = len(p)
            run.append(p)
            if len(p) < size:  # a shorter segment can only end a run
                self._send_run(run, size)
                run = []
        if run:
            self._send_run(run, size)

    def _send_run(self, run: list[bytes], size: int) -> None:
        if len(run) == 1:
            self.sock.sendto(run[0], self.dst)
        else:
            try:
                self.sock.sendmsg([b"".join(run)], [(socket.SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))], 0,
                                  self.dst)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EIO):
                    raise
                self.gso = False  # a kernel or route without UDP GSO: one datagram per call
                for p in run:
                    self.sock.sendto(p, self.dst)
        self.sent += len(run)
        self.bytes += sum(map(len, run))

    def close(self) -> None:
        self.sock.close()


@dataclass
class Datagram:
    payload: bytes
    src: tuple
    tos: int  # the TOS / traffic class byte as received (-1 if the kernel gave none)
    time_ns: int

    @property
    def dscp(self) -> int:
        return self.tos >> 2 if self.tos >= 0 else -1


class Receiver:
    """A bound UDP socket that hands back batches of datagrams with their seen TOS; with
    `dscp`, replies sent from it (`sendto`) carry that DSCP."""

    def __init__(self, bind: str = "0.0.0.0", port: int = GRADIENT_PORT, rcvbuf: int = BUFFER_BYTES,
                 dscp: int | None = None):
        self.sock = socket.socket(family(bind), socket.SOCK_DGRAM)
        if dscp is not None:
            set_tos(self.sock, dscp)
        self.v6 = family(bind) == socket.AF_INET6
        if self.v6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
        else:
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        self.rcvbuf = _set_buffers(self.sock, socket.SO_RCVBUF, rcvbuf)
        # replies (a reliable broadcast's chunks, ACKs) queue here rather than fail while
        # the host's port drains them
        self.sndbuf = _set_buffers(self.sock, socket.SO_SNDBUF, BUFFER_BYTES)
        self.sock.bind((bind, port))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]

    def _tos(self, ancillary) -> int:
        for level, kind, data in ancillary:
            if (level, kind) in ((socket.IPPROTO_IP, socket.IP_TOS),
                                 (socket.IPPROTO_IPV6, socket.IPV6_TCLASS)):
                return data[0] if len(data) == 1 else int.from_bytes(data[:4], sys.byteorder)
        return -1

    def recv_batch(self, max_packets: int = 512, timeout: float | None = 0.1) -> list[Datagram]:
        """Wait up to `timeout` for the first datagram, then drain what is queued (at most
        `max_packets`) without blocking."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return []
        out = []
        while len(out) < max_packets:
            try:
                data, anc, _, src = self.sock.recvmsg(65535, 64)
            except BlockingIOError:
                break
            out.append(Datagram(data, src, self._tos(anc), time.time_ns()))
        return out

    def sendto(self, payload: bytes, addr: tuple) -> bool:
        """Send; False when the socket buffer is full (as good as a loss on the wire)."""
        try:
            self.sock.sendto(payload, addr)
            return True
        except BlockingIOError:
            return False

    def unsent_bytes(self) -> int:
        """Bytes this socket handed the kernel that have not left the host yet (SIOCOUTQ)."""
        return struct.unpack("i", fcntl.ioctl(self.sock, termios.TIOCOUTQ, b"\0" * 4))[0]

    def close(self) -> None:
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.agents.transport", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("send", help="send numbered datagrams")
    s.add_argument("--dst", required=True)
    s.add_argument("--port", type=int, default=GRADIENT_PORT)
    s.add_argument("--dscp", type=int, default=0)
    s.add_argument("--ecn", type=int, default=0)
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--size", type=int, default=1000, help="payload bytes, sequence number included")
    s.add_argument("--rate", type=float, default=None, help="pace to this many bits/s")
    r = sub.add_parser("recv", help="receive and print one JSON line per datagram")
    r.add_argument("--bind", default="0.0.0.0")
    r.add_argument("--port", type=int, default=GRADIENT_PORT)
    r.add_argument("--idle", type=float, default=1.0, help="stop after this many idle seconds")
    a = ap.parse_args(argv)
    if a.cmd == "send":
        tx = Sender(a.dst, a.port, a.dscp, a.ecn, a.rate)
        pad = b"\0" * max(0, a.size - _SEQ.size)
        tx.send_all(_SEQ.pack(i & 0xFFFFFFFF) + pad for i in range(a.count))
        print(json.dumps({"sent": tx.sent, "bytes": tx.bytes, "sndbuf": tx.sndbuf}))
        return 0
    rx = Receiver(a.bind, a.port)
    while batch := rx.recv_batch(timeout=a.idle):
        for d in batch:
            seq = _SEQ.unpack_from(d.payload)[0] if len(d.payload) >= _SEQ.size else -1
            print(json.dumps({"seq": seq, "len": len(d.payload), "dscp": d.dscp, "tos": d.tos,
                              "src": d.src[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
