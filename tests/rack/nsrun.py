"""Helpers that run inside a rack namespace (python -m tests.rack.nsrun CMD ...):
send scapy-built packets, or receive UDP and print what arrived as JSON."""

import fcntl
import json
import os
import select
import socket
import sys
import time


def send(hexframes: str, iface: str = "eth1", gap: float = 0.0) -> None:
    from scapy.all import conf
    sock = conf.L2socket(iface=iface)
    for h in hexframes.split(","):
        sock.send(bytes.fromhex(h))
        if gap:
            time.sleep(gap)
    sock.close()


def _udp_sender(dst: str, tos: int) -> socket.socket:
    """A UDP socket marking its packets with `tos` (IPv4 TOS / IPv6 traffic class)."""
    v6 = ":" in dst
    s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET, socket.SOCK_DGRAM)
    if v6:
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
    else:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    return s


def udp_burst(dst: str, count: int, size: int, tos: int, port: int = 47001, tag: int = 0) -> None:
    """`count` datagrams of `size` bytes, each starting with (tag, sequence number)."""
    s = _udp_sender(dst, tos)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 22)
    pad = b"\x00" * max(0, size - 8)
    for i in range(count):
        s.sendto(tag.to_bytes(4, "big") + i.to_bytes(4, "big") + pad, (dst, port))


def udp_flows(dst: str, count: int, tos: int = 0, port: int = 47001, tag: int = 0) -> None:
    """One datagram from each of `count` sockets: `count` flows (source ports) for ECMP."""
    for i in range(count):
        s = _udp_sender(dst, tos)
        s.sendto(tag.to_bytes(4, "big") + i.to_bytes(4, "big"), (dst, port))
        s.close()


def gso_burst(dst: str, count: int, size: int, dscp: int, port: int = 47001, tag: int = 0) -> None:
    """Like udp_burst, through trimlab's Sender (UDP GSO messages in sendmmsg calls); prints
    how many GSO messages it handed the kernel and whether GSO was used."""
    from trimlab.agents import transport

    tx = transport.Sender(dst, port, dscp, ecn=1)
    messages, real = [], transport._LIBC

    class Counting:
        def __getattr__(self, name):
            return getattr(real, name)

        def sendmmsg(self, fd, msgs, vlen, flags):
            n = real.sendmmsg(fd, msgs, vlen, flags)
            messages.append(max(n, 0))
            return n
    transport._LIBC = Counting()
    pad = b"\x00" * max(0, size - 8)
    tx.send_all(tag.to_bytes(4, "big") + i.to_bytes(4, "big") + pad for i in range(count))
    print(json.dumps({"gso": tx.gso, "gso_messages": sum(messages), "sent": tx.sent}))


def send_payloads(dst: str, path: str, tos: int, port: int = 47000) -> None:
    """Send the UDP payloads in `path` (one hex string per line)."""
    s = _udp_sender(dst, tos)
    for line in open(path):
        s.sendto(bytes.fromhex(line.strip()), (dst, port))
        time.sleep(0.0002)


def udp_receive(v6: str, port: int = 47001, idle: float = 1.5, ready: str = "", sent: str = "") -> None:
    """Receive until idle; print [[first 24 bytes as hex, length, tos], ...] in arrival order.
    With `sent` (a file the test creates once its senders are done), the idle time counts
    only from then: a sender slow to start (a busy host) is waited for, however long."""
    s = socket.socket(socket.AF_INET6 if v6 == "6" else socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 25)
    if v6 == "6":
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
    else:
        s.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
    s.bind(("::" if v6 == "6" else "0.0.0.0", port))
    if ready:
        open(ready, "w").close()
    got = []
    quiet_since = None if sent else time.monotonic()  # idle counts from here
    while True:
        if select.select([s], [], [], 0.05)[0]:
            data, anc, _, _ = s.recvmsg(65535, 64)
            tos = anc[0][2][0] if anc else -1
            got.append([data[:24].hex(), len(data), tos])
            quiet_since = time.monotonic() if quiet_since is not None else None
        elif quiet_since is None:
            if os.path.exists(sent):  # the senders are done: what is in flight drains now
                quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since >= idle:
            break
    print(json.dumps(got))


def tcp_sink(port: int, tos: int) -> None:
    """Accept one TCP connection and read it to its end; the listener and the connection
    send on `tos` (their ACKs' class). Prints "listening", then the bytes read."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    srv.bind(("0.0.0.0", port))
    srv.listen(1)
    print("listening", flush=True)
    c, _ = srv.accept()
    c.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    got = 0
    while data := c.recv(1 << 16):
        got += len(data)
    print(got, flush=True)


def _total_retrans(s: socket.socket) -> int:
    return int.from_bytes(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)[100:104], "little")  # tcpi_total_retrans


def tcp_send(dst: str, port: int, size: int, tos: int = 0) -> None:
    """Connect, print "connected", wait for a line on stdin, send `size` bytes and wait until
    every one is acknowledged (nothing left in the send queue), then print the segments
    this connection retransmitted meanwhile (TCP_INFO), and wait for a line before closing:
    the data phase alone, without the handshake's or the close's segments."""
    s = socket.create_connection((dst, port))
    s.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)
    print("connected", flush=True)
    sys.stdin.readline()
    before = _total_retrans(s)
    s.sendall(b"\0" * size)
    outq = bytearray(4)
    while True:  # SIOCOUTQ: bytes not yet acknowledged
        fcntl.ioctl(s.fileno(), 0x5411, outq)
        if not int.from_bytes(outq, "little"):
            break
        time.sleep(0.001)
    print(_total_retrans(s) - before, flush=True)
    sys.stdin.readline()
    s.close()


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    fn = {"send": send, "udp_burst": udp_burst, "udp_flows": udp_flows, "gso_burst": gso_burst, "udp_receive": udp_receive,
          "send_payloads": send_payloads, "tcp_sink": tcp_sink, "tcp_send": tcp_send}[cmd]
    kwargs = dict(a.split("=", 1) for a in args)
    for k in ("count", "size", "tos", "dscp", "port", "tag"):
        if k in kwargs:
            kwargs[k] = int(kwargs[k])
    for k in ("gap", "idle"):
        if k in kwargs:
            kwargs[k] = float(kwargs[k])
    fn(**kwargs)
