"""The reliable channel (port + 1, the non-trimmable control DSCP): a `Broadcast` cuts a
tensor (parameters, or an averaged gradient shard) into chunks and retransmits what a
receiver has not acknowledged (selective-ACK bitmaps), so every receiver ends with the
same bytes. A retransmission waits until everything sent before has left the host (the
socket's unsent bytes are zero) and one RTO more: a shard larger than what the port
drains in an RTO would otherwise be sent again and again before its first copy left,
filling the socket buffer so that nothing — ACKs included — got out (a collapse seen
with 1 M-parameter models at 100 Mbit/s). A receiver acknowledges every chunk it sees,
again if it is a duplicate, so a lost ACK only costs a retransmission. The node does the
receiving.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field

import numpy as np

from trimlab import wire
from trimlab.agents.context import NodeContext
from trimlab.agents.failure import ProtocolError

PARAMS, ACK, BYE = 1, 2, 3
CTRL_VERSION = 1
# kind, version, job, step, shard, first (chunk index | first chunk acked), count
CTRL = struct.Struct("!BBHIHHH")
MAX_ACK_CHUNKS = 8192  # one ACK covers up to this many chunks (a 1 KiB bitmap)


def chunk_bytes(mtu: int, ipv6: bool) -> int:
    return (mtu - wire.ip_udp_overhead(ipv6) - CTRL.size) // 4 * 4


class Broadcast:
    """One parameter shard of one step, to every destination, until each acknowledged all."""

    def __init__(self, node_ctx: NodeContext, step: int, shard: int, data: bytes, dests: list[str],
                 rto_s: float = 0.05, give_up_s: float = 10.0):
        size = chunk_bytes(node_ctx.mtu, node_ctx.ipv6)
        self.node_ctx, self.step, self.shard = node_ctx, step, shard
        self.chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
        if len(self.chunks) > 0xFFFF:
            raise ProtocolError(f"a parameter shard of {len(data)} bytes needs {len(self.chunks)} "
                                f"chunks; at most 65535 fit the header: use more shards or a larger MTU")
        self.rto_s, self.give_up_s = rto_s, give_up_s
        now = time.monotonic()
        self.pending = {d: set(range(len(self.chunks))) for d in dests}
        self.progress = dict.fromkeys(dests, now)
        self.drained_at: float | None = None  # when the socket was first seen empty since a send
        self.retransmits = 0
        # first transmission chunk-major: every destination completes at about the same time
        for i, chunk in enumerate(self.chunks):
            head = CTRL.pack(PARAMS, CTRL_VERSION, node_ctx.job, step, shard, i, len(self.chunks))
            for d in dests:
                node_ctx.send_control(head + chunk, d)

    def _send(self, dest: str) -> None:
        n = len(self.chunks)
        for i in sorted(self.pending[dest]):
            head = CTRL.pack(PARAMS, CTRL_VERSION, self.node_ctx.job, self.step, self.shard, i, n)
            if not self.node_ctx.send_control(head + self.chunks[i], dest):
                break  # the socket is full: the rest goes in a later round

    def on_ack(self, dest: str, first: int, bitmap: np.ndarray) -> None:
        pending = self.pending.get(dest)
        if not pending:
            return
        acked = {first + int(i) for i in np.flatnonzero(bitmap)}
        if pending & acked:
            pending -= acked
            self.progress[dest] = time.monotonic()

    def poll(self, now: float) -> None:
        waiting = [d for d, pending in self.pending.items() if pending]
        for dest in waiting:
            if now - self.progress[dest] > self.give_up_s:
                raise ProtocolError(f"{self.node_ctx.name_of(dest)} stopped acknowledging the "
                                    f"parameters of step {self.step} (shard {self.shard}) for "
                                    f"{self.give_up_s:g} s; {self.node_ctx.state()}")
        if not waiting:
            return
        if self.node_ctx.unsent_control():  # earlier sends are still leaving the host
            self.drained_at = None
            return
        if self.drained_at is None:
            self.drained_at = now
        if now - self.drained_at >= self.rto_s:
            for dest in waiting:
                self.retransmits += len(self.pending[dest])
                self._send(dest)
            self.drained_at = None

    @property
    def done(self) -> bool:
        return not any(self.pending.values())


@dataclass
class Assembly:
    nchunks: int
    parts: dict[int, bytes] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return len(self.parts) == self.nchunks

    def data(self) -> bytes:
        return b"".join(self.parts[i] for i in range(self.nchunks))
