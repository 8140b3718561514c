"""The all-gather's reliable channel: one TCP connection between every two ranks, on the
data network's control class (the control DSCP in every segment), port + 2. The kernel
paces, segments, acknowledges and retransmits; a shard costs the agent one message header
and a few send and receive calls instead of a Python round per datagram (the UDP channel
of trimlab.agents.reliable took 87 ms to all-gather 1 M parameters among 4 ranks at
1 Gbit/s, whose wire time is 13 ms: `trimlab bench ddp --rates 1gbit`).

A rank connects to every lower rank (retrying until that rank listens) and accepts every
higher one; each connection opens with HELLO (job, rank). Messages are (job, kind, step,
shard, length) + bytes, in order on each connection: DATA carries a shard; SENT (no bytes)
says the sender has handed its gradient packets of (step, wire bucket) for us to its
kernel, so a receiver that got none of them waits one deadline more, not the step
timeout. The node's pump moves them: it accepts, reads whatever arrived into the message
being received, and writes what is queued where the socket has room, so the channel
progresses while the node waits for anything else.
"""

from __future__ import annotations

import collections
import socket
import struct
import time

from trimlab.agents.failure import ProtocolError
from trimlab.agents.transport import set_tos

STREAM_VERSION = 2
HELLO = struct.Struct("!BHH")  # version, job, rank
MSG = struct.Struct("!HBIHI")  # job, kind, step, shard, length
DATA, SENT = 0, 1
READ_BYTES = 1 << 20  # one receive call reads up to this much
MAX_PENDING = 64  # accepted connections still waiting for their HELLO


class _Peer:
    """One connection: what is queued to send, and the message being received."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.out: collections.deque[memoryview] = collections.deque()
        self.head = bytearray()
        self.body: bytearray | None = None
        self.key: tuple[int, int] | None = None
        self.got = 0
        self.closed = False  # the peer closed its end: it sends nothing more


class Mesh:
    """The connections of one rank to every other rank (`addrs`: rank -> data address)."""

    def __init__(self, job: int, rank: int, addrs: dict[int, str], port: int, dscp: int, ipv6: bool,
                 name_of, sent_to_us: dict[str, tuple[int, int]], discarded: collections.Counter):
        self.job, self.rank, self.port, self.dscp, self.name_of = job, rank, port, dscp, name_of
        self.family = socket.AF_INET6 if ipv6 else socket.AF_INET
        self.me = addrs[rank]
        self.addrs = {r: a for r, a in addrs.items() if r != rank}
        self.rank_of = {a: r for r, a in self.addrs.items()}
        self.peers: dict[int, _Peer] = {}
        self.received: dict[tuple[str, int, int], bytearray] = {}  # (address, step, shard) -> bytes
        self.sent_to_us = sent_to_us  # address -> newest (step, wire bucket) it marked SENT (the node's)
        self.listener = socket.socket(self.family, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind((addrs[rank], port))
        self.listener.listen(len(addrs))
        self.listener.setblocking(False)
        self.hello: dict[socket.socket, tuple[str, bytearray]] = {}  # accepted, HELLO not yet whole
        self.discarded = discarded  # the node's: a connection of no rank of this job

    def _tune(self, s: socket.socket) -> None:
        set_tos(s, self.dscp)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a message's tail leaves at once

    def connect(self, timeout_s: float) -> None:
        """Connect to every lower rank not yet connected, each retried until it listens."""
        for r, addr in sorted(self.addrs.items()):
            if r > self.rank or r in self.peers:
                continue
            end = time.monotonic() + timeout_s
            while True:
                s = socket.socket(self.family, socket.SOCK_STREAM)
                self._tune(s)
                s.bind((self.me, 0))  # from our data address: the peer knows ranks by address
                s.settimeout(max(0.1, end - time.monotonic()))
                try:
                    s.connect((addr, self.port))
                    s.sendall(HELLO.pack(STREAM_VERSION, self.job, self.rank))
                    break
                except OSError as exc:
                    s.close()
                    if time.monotonic() > end:
                        raise ProtocolError(f"cannot connect the all-gather stream to {self.name_of(addr)} "
                                            f"port {self.port} within {timeout_s:g} s: {exc}") from None
                    time.sleep(0.05)  # that rank is still starting
            s.setblocking(False)
            self.peers[r] = _Peer(s)

    @property
    def connected(self) -> bool:
        return len(self.peers) == len(self.addrs)

    def sockets(self) -> tuple[list[socket.socket], list[socket.socket]]:
        """(to read, to write): the listener while a higher rank is missing, every
        connection, and those with something queued."""
        live = [p for p in self.peers.values() if not p.closed]
        read = [p.sock for p in live] + list(self.hello)
        if not self.connected:
            read.append(self.listener)
        return read, [p.sock for p in live if p.out]

    def send(self, rank: int, step: int, shard: int, data: bytes) -> None:
        """Queue a message to `rank` (written as the socket takes it, by `progress`)."""
        peer = self.peers.get(rank)
        if peer is None or peer.closed:
            raise ProtocolError(f"no all-gather stream to {self.name_of(self.addrs[rank])} "
                                f"({'it closed it' if peer else 'not connected yet'})")
        peer.out.append(memoryview(MSG.pack(self.job, DATA, step, shard, len(data))))
        if data:
            peer.out.append(memoryview(data))
        self._write(peer)

    def mark_sent(self, rank: int, step: int, bucket: int) -> None:
        """Tell `rank` that our gradient packets of (step, wire bucket) have left."""
        peer = self.peers.get(rank)
        if peer is not None and not peer.closed:
            peer.out.append(memoryview(MSG.pack(self.job, SENT, step, bucket, 0)))
            self._write(peer)

    def unsent(self) -> int:
        """Bytes queued for peers that are still there."""
        return sum(len(m) for p in self.peers.values() if not p.closed for m in p.out)

    def progress(self, readable: list, writable: list) -> None:
        if self.listener in readable:
            self._accept()
        for s in [s for s in readable if s in self.hello]:
            self._greet(s)
        by_sock = {p.sock: (r, p) for r, p in self.peers.items() if not p.closed}
        for s in writable:
            if s in by_sock:
                self._write(by_sock[s][1])
        for s in readable:
            if s in by_sock:
                self._read(*by_sock[s])

    def _accept(self) -> None:
        while True:
            try:
                s, src = self.listener.accept()
            except BlockingIOError:
                return
            s.setblocking(False)
            if len(self.hello) >= MAX_PENDING:  # connections that never say HELLO: the oldest goes
                old = next(iter(self.hello))
                del self.hello[old]
                old.close()
                self.discarded["stream_unknown"] += 1
            self.hello[s] = (src[0], bytearray())

    def _greet(self, s: socket.socket) -> None:
        """Read an accepted connection's HELLO as it comes (never waiting on a silent one);
        a whole one from a higher rank of this job makes it that rank's connection."""
        src, got = self.hello[s]
        try:
            part = s.recv(HELLO.size - len(got))
        except BlockingIOError:
            return
        except OSError:
            part = b""
        got += part
        if part and len(got) < HELLO.size:
            return
        del self.hello[s]
        rank = self.rank_of.get(src, -1)
        if len(got) < HELLO.size or HELLO.unpack(got) != (STREAM_VERSION, self.job, rank) \
                or rank < self.rank or rank in self.peers:
            self.discarded["stream_unknown"] += 1
            s.close()
            return
        self._tune(s)
        self.peers[rank] = _Peer(s)

    def _write(self, peer: _Peer) -> None:
        while peer.out:
            try:
                n = peer.sock.send(peer.out[0])
            except BlockingIOError:
                return
            except OSError as exc:
                raise ProtocolError(f"the all-gather stream to {self._name(peer)} failed: {exc}") from None
            if n < len(peer.out[0]):
                peer.out[0] = peer.out[0][n:]
                return
            peer.out.popleft()

    def _read(self, rank: int, peer: _Peer) -> None:
        addr = self.addrs[rank]
        while True:
            try:
                if peer.body is None:
                    part = peer.sock.recv(MSG.size - len(peer.head))
                    n = len(part)
                    peer.head += part
                else:
                    n = peer.sock.recv_into(memoryview(peer.body)[peer.got:], min(READ_BYTES, len(peer.body) - peer.got))
                    peer.got += n
            except BlockingIOError:
                return
            except OSError as exc:
                raise ProtocolError(f"the all-gather stream from {self.name_of(addr)} failed: {exc}") from None
            if n == 0 and (peer.body is None or peer.got < len(peer.body)):
                self._closed(rank)
                return
            if peer.body is None and len(peer.head) == MSG.size:
                job, kind, step, shard, length = MSG.unpack(peer.head)
                if job != self.job or kind not in (DATA, SENT):
                    raise ProtocolError(f"the all-gather stream from {self.name_of(addr)} carries job {job} "
                                        f"kind {kind}, not job {self.job} kind {DATA} or {SENT}")
                peer.head = bytearray()
                if kind == SENT:
                    self.sent_to_us[addr] = max(self.sent_to_us.get(addr, (-1, -1)), (step, shard))
                    continue
                peer.body, peer.key, peer.got = bytearray(length), (step, shard), 0
            if peer.body is not None and peer.got == len(peer.body):
                self.received[(addr, *peer.key)] = peer.body
                peer.body, peer.key = None, None

    def _closed(self, rank: int) -> None:
        """A peer that closed its end: it has sent everything it will (it finished)."""
        peer = self.peers[rank]
        if peer.body is not None or peer.head:
            raise ProtocolError(f"the all-gather stream from {self.name_of(self.addrs[rank])} closed in the "
                                f"middle of a message")
        peer.sock.close()
        peer.closed = True

    def _name(self, peer: _Peer) -> str:
        return next((self.name_of(self.addrs[r]) for r, p in self.peers.items() if p is peer), "a peer")

    def end(self) -> None:
        """No more messages from this rank: every connection's sending side shut."""
        for p in self.peers.values():
            if not p.closed:
                try:
                    p.sock.shutdown(socket.SHUT_WR)
                except OSError:
                    pass  # the peer is gone already

    def all_ended(self) -> bool:
        return all(p.closed for p in self.peers.values())

    def close(self) -> None:
        for p in self.peers.values():
            if not p.closed:
                p.sock.close()
        for s in self.hello:
            s.close()
        self.listener.close()
