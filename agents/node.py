"""A `Node`: both sockets of one host (gradients on `port`, the reliable channel on
`port + 1`) and everything in flight: broadcasts, assemblies, collectors. It does all the
receiving, accepts only packets of its job from the rack's known data addresses, bounds
what a step may hold, and counts (never raises on) whatever it discards."""

from __future__ import annotations

import collections
import select
import time

import numpy as np
import torch

from trimlab.agents import rx
from trimlab.agents.collect import Collector
from trimlab.agents.context import NodeContext
from trimlab.agents.failure import ProtocolError
from trimlab.agents.reliable import (
    ACK,
    BYE,
    CTRL,
    CTRL_VERSION,
    MAX_ACK_CHUNKS,
    PARAMS,
    Assembly,
    Broadcast,
)
from trimlab.agents.rx import Arrived
from trimlab.agents.stream import Mesh
from trimlab.agents.transport import Batch, Datagram, Receiver, packed_addr
from trimlab.codec import get_codec
from trimlab.config import AgentConfig


MIN_BATCH = 64  # datagrams a gradient batch may read at least (Node._wanted)


class Node:
    """Both sockets of one host, and everything in flight: broadcasts, assemblies, collectors."""

    def __init__(self, cfg: AgentConfig, bind: str, peers: dict[str, str], receive_gradients: bool):
        t, c = cfg.transport, cfg.codec
        self.job, self.seed, self.mtu, self.ipv6 = cfg.job, cfg.seed, cfg.mtu, t.ipv6
        self.codec = get_codec(c.name, **c.params)
        self.span, self.coords = c.span, c.coords
        self.port, self.ctrl_port = t.port, t.control_port
        self.peers = peers  # data address -> host name: the only sources accepted
        self.peer_addrs = list(peers)  # a datagram's peer index -> its address
        self._peer_table = np.stack([packed_addr(a) for a in self.peer_addrs]) if peers \
            else np.zeros((0, 16), dtype=np.uint8)
        self._peer_index: dict[str, int] = {}  # peer_index's answers
        slot = -(-max(cfg.mtu, 576) // 64) * 64  # any datagram that fits the MTU
        self.data = Receiver(bind, self.port, slot=slot) if receive_gradients else None
        self.ctrl = Receiver(bind, self.ctrl_port, dscp=t.control_dscp, slot=slot)
        self.broadcasts: list[Broadcast] = []
        self.assemblies: dict[tuple, Assembly] = {}
        self.completed: dict[tuple, int] = {}  # (src, step, shard) delivered -> its chunk count
        self.collectors: dict[tuple, Collector] = {}
        self.done_steps: set[tuple] = set()  # (step, bucket) already reduced: late packets
        # packets of a (step, bucket) no collector was opened for yet (a faster peer), kept
        # for it up to a bound; past the bound they are counted as unexpected
        self.early: dict[tuple, list[Arrived]] = {}
        self.early_bytes, self.early_max_bytes = 0, 8 << 20
        self.discarded: collections.Counter = collections.Counter()
        self.last_heard: dict[str, float] = {}  # peer address -> when anything last came from it
        self.sent_to_us: dict[str, tuple[int, int]] = {}  # peer address -> newest (step, bucket) it says it sent
        self.bye = False
        self.mesh: Mesh | None = None  # the all-gather's TCP connections (a sharded all-reduce's node)
        self.ctx = NodeContext(self.codec, self.job, self.seed, self.span, self.coords, self.mtu, self.ipv6,
                               self.peer_addrs, self.peer_index, self.name_of, self.last_heard, self.discarded,
                               lambda data, dest: self.ctrl.sendto(data, (dest, self.ctrl_port)),
                               self.ctrl.unsent_bytes, self.state)

    def close(self) -> None:
        """Close both sockets."""
        if self.data is not None:
            self.data.close()
        self.ctrl.close()
        if self.mesh is not None:
            self.mesh.close()

    def state(self) -> str:
        """What is in flight, for error messages: assemblies, unacknowledged chunks, discards."""
        asm = ", ".join(f"{self.peers.get(k[0], k[0])} step {k[1]} shard {k[2]}: {len(a.parts)}/{a.nchunks}"
                        for k, a in self.assemblies.items())
        out = ", ".join(f"step {b.step} shard {b.shard} to {self.peers.get(d, d)}: {len(p)} chunks"
                        for b in self.broadcasts for d, p in b.pending.items() if p)
        streams = ""
        if self.mesh is not None:
            streams = (f"all-gather streams: {len(self.mesh.peers)} of {len(self.mesh.addrs)} connected, "
                       f"{self.mesh.unsent()} bytes queued; ")
        return (f"{streams}receiving [{asm or 'nothing'}]; unacknowledged [{out or 'nothing'}] "
                f"({self.ctrl.unsent_bytes()} bytes not yet sent); "
                f"discarded {dict(self.discarded) or 'nothing'}; collectors {sorted(self.collectors)}")

    def name_of(self, addr: str) -> str:
        return f"{self.peers.get(addr, 'unknown host')} ({addr})"

    def peer_index(self, addr: str) -> int:
        """The index of a peer's address in `peer_addrs`, -1 for none (any spelling of it)."""
        index = self._peer_index.get(addr)
        if index is None:
            hit = np.flatnonzero((self._peer_table == packed_addr(addr)).all(1))
            index = self._peer_index[addr] = int(hit[0]) if len(hit) else -1
        return index

    # receiving
    def pump(self, timeout: float = 0.01) -> None:
        socks = [s.sock for s in (self.data, self.ctrl) if s is not None]
        streams, writing = self.mesh.sockets() if self.mesh is not None else ([], [])
        ready, writable, _ = select.select(socks + streams, writing, [], timeout)
        if self.mesh is not None:
            self.mesh.progress(ready, writable)
        now = time.monotonic()
        if self.data is not None and self.data.sock in ready:
            batch = self.data.recv_many(timeout=0, max_packets=self._wanted())
            if batch is not None:
                self._on_gradients(batch, now)
        if self.ctrl.sock in ready:
            acks: dict[tuple, str] = {}
            for d in self.ctrl.recv_batch(timeout=0):
                self._heard(d, now)
                key = self._on_control(d)
                if key:
                    acks[key] = d.src[0]
            for key, src in acks.items():  # one ACK per shard per batch, covering everything
                self._ack(src, key)
        now = time.monotonic()
        for b in self.broadcasts:
            b.poll(now)
        self.broadcasts = [b for b in self.broadcasts if not b.done]

    def _wanted(self) -> int | None:
        """How many gradient packets the open collectors still miss (None: no bound), and
        at least MIN_BATCH. A batch read no further than that ends where the step does: the
        next step's packets stay queued until its collector is open, instead of being
        copied aside as early (the floor: one lost packet must not make the wait for the
        deadline read the next step's packets one call each)."""
        want = sum(c.missing for c in self.collectors.values())
        return max(want, MIN_BATCH) if want else None

    def _heard(self, d: Datagram, now: float) -> None:
        if d.src[0] in self.peers:
            self.last_heard[d.src[0]] = now

    def _on_gradients(self, b: Batch, now: float) -> None:
        """Check a batch of gradient datagrams (rx.route: source, header, job) and hand each
        (step, bucket)'s share to its collector, or keep it for one about to open."""
        counts = np.zeros(len(rx.REASONS), dtype=np.int64)
        routed = rx.route(b, self._peer_table, self.job, counts)
        rx.count(self.discarded, counts)
        heard = routed.peer[routed.peer >= 0]
        if len(heard):
            for p in (heard[:1] if heard[0] == heard[-1] and (heard == heard[0]).all() else np.unique(heard)):
                self.last_heard[self.peer_addrs[p]] = now
        if not routed.passed:
            return
        head = routed.head
        arrived = Arrived(b.data, b.length, b.dscp, routed.peer, head, b.time_ns, routed.cols)
        stream = head["step"].astype(np.int64) << 16 | head["bucket"]
        n = len(b)
        if routed.passed == n and stream[0] == stream[-1] and (stream == stream[0]).all():
            shares = [(int(stream[0]), None)]  # the usual batch: one bucket's datagrams only
        else:
            rows = np.flatnonzero(routed.status == 0)
            shares = [(key, rows[stream[rows] == key]) for key in np.unique(stream[rows]).tolist()]
        for key, mine in shares:
            step_bucket = (key >> 16, key & 0xFFFF)
            count = n if mine is None else len(mine)
            coll = self.collectors.get(step_bucket)
            if coll is not None:  # (the collector copies what it keeps: no copy of a whole batch)
                coll.add(arrived, mine)
            elif step_bucket in self.done_steps:
                self.discarded["late"] += count
            elif self.early_bytes + int((b.length if mine is None else b.length[mine]).sum()) <= self.early_max_bytes:
                kept = arrived.take(np.arange(n) if mine is None else mine)
                self.early.setdefault(step_bucket, []).append(kept)
                self.early_bytes += kept.nbytes
            else:
                self.discarded["unexpected"] += count

    def _on_control(self, d: Datagram) -> tuple | None:
        src = d.src[0]
        if src not in self.peers or len(d.payload) < CTRL.size:
            self.discarded["control_unknown" if src not in self.peers else "control_short"] += 1
            return None
        kind, ver, job, step, shard, first, count = CTRL.unpack_from(d.payload)
        if ver != CTRL_VERSION or job != self.job:
            self.discarded["control_other"] += 1
            return None
        body = d.payload[CTRL.size:]
        if kind == PARAMS:
            key = (src, step, shard)
            if key in self.completed:  # a retransmission: our ACK was lost, send it again
                return key
            asm = self.assemblies.get(key)
            if asm is None:
                asm = self.assemblies[key] = Assembly(count)
            if first < asm.nchunks and count == asm.nchunks:
                asm.parts.setdefault(first, body)
            return key
        if kind == ACK:
            bitmap = np.unpackbits(np.frombuffer(body, dtype=np.uint8), bitorder="little")[:count]
            for b in self.broadcasts:
                if b.shard == shard and b.step == step:
                    b.on_ack(src, first, bitmap)
            return None
        if kind == BYE:
            self.bye = True
        return None

    def _ack(self, src: str, key: tuple) -> None:
        if key in self.completed:
            have = np.ones(self.completed[key], dtype=np.uint8)
        else:
            have = np.zeros(self.assemblies[key].nchunks, dtype=np.uint8)
            have[list(self.assemblies[key].parts)] = 1
        for first in range(0, len(have), MAX_ACK_CHUNKS):
            bits = have[first:first + MAX_ACK_CHUNKS]
            head = CTRL.pack(ACK, CTRL_VERSION, self.job, key[1], key[2], first, len(bits))
            self.ctrl.sendto(head + np.packbits(bits, bitorder="little").tobytes(), (src, self.ctrl_port))

    # sending
    def broadcast(self, step: int, shard: int, values: torch.Tensor | bytes, dests: list[str],
                  **kw) -> Broadcast:
        """Send `values` (float32 values, or bytes as they are) reliably to `dests`."""
        data = values if isinstance(values, bytes) else values.to(torch.float32).contiguous().numpy().tobytes()
        b = Broadcast(self.ctx, step, shard, data, dests, **kw)
        self.broadcasts.append(b)
        return b

    def bye_all(self, dests: list[str]) -> None:
        head = CTRL.pack(BYE, CTRL_VERSION, self.job, 0, 0, 0, 0)
        for _ in range(3):
            for d in dests:
                self.ctrl.sendto(head, (d, self.ctrl_port))

    # waiting
    def wait_params(self, src: str, step: int, shard: int, numel: int, timeout_s: float) -> torch.Tensor:
        """The parameter shard `shard` of `step` from `src` (float32), once every chunk arrived."""
        data = self.wait_bytes(src, step, shard, timeout_s)
        if len(data) != 4 * numel:
            raise ProtocolError(f"parameters of step {step} from {self.name_of(src)}: "
                                f"{len(data) // 4} values, expected {numel}")
        return torch.frombuffer(bytearray(data), dtype=torch.float32)

    def wait_bytes(self, src: str, step: int, shard: int, timeout_s: float) -> bytes:
        """The bytes of broadcast (step, shard) from `src`, once every chunk arrived."""
        key = (src, step, shard)
        t0 = time.monotonic()
        while True:
            asm = self.assemblies.get(key)
            if asm is not None and asm.complete:
                data = asm.data()
                del self.assemblies[key]
                self.completed[key] = asm.nchunks  # duplicates are still acknowledged
                return data
            if time.monotonic() - t0 > timeout_s:
                raise ProtocolError(f"no parameters of step {step} (shard {shard}) from "
                                    f"{self.name_of(src)} within {timeout_s:g} s; {self.state()}")
            self.pump()

    def wait_streamed(self, src: str, step: int, shard: int, timeout_s: float) -> bytearray:
        """The message (step, shard) from `src` on the all-gather stream, once all of it came."""
        key = (src, step, shard)
        t0 = time.monotonic()
        while key not in self.mesh.received:
            if time.monotonic() - t0 > timeout_s:
                raise ProtocolError(f"no all-gather message of step {step} (shard {shard}) from "
                                    f"{self.name_of(src)} within {timeout_s:g} s; {self.state()}")
            self.pump()
        return self.mesh.received.pop(key)

    def wait_stream_peers(self, timeout_s: float) -> None:
        """Until every higher rank connected its all-gather stream (the lower ones we connect)."""
        t0 = time.monotonic()
        while not self.mesh.connected:
            if time.monotonic() - t0 > timeout_s:
                missing = [self.name_of(a) for r, a in self.mesh.addrs.items() if r not in self.mesh.peers]
                raise ProtocolError(f"no all-gather stream from {', '.join(missing)} within {timeout_s:g} s")
            self.pump()

    def flush_streams(self, timeout_s: float) -> None:
        """Until the kernel holds everything queued on the all-gather streams."""
        t0 = time.monotonic()
        while self.mesh is not None and self.mesh.unsent():
            if time.monotonic() - t0 > timeout_s:
                raise ProtocolError(f"all-gather streams not drained within {timeout_s:g} s "
                                    f"(a peer stopped reading); {self.state()}")
            self.pump()

    def close_streams(self, timeout_s: float) -> None:
        """Flush, end our side of every stream, and read until every peer ended its own."""
        self.flush_streams(timeout_s)
        self.mesh.end()
        t0 = time.monotonic()
        while not self.mesh.all_ended():
            if time.monotonic() - t0 > timeout_s:
                raise ProtocolError(f"all-gather streams not ended by every peer within {timeout_s:g} s")
            self.pump()

    def expect(self, step: int, bucket: int, ranks: dict[int, str], numel: int,
               deadline_s: float) -> Collector:
        coll = Collector(self.ctx, step, bucket, ranks, numel, deadline_s)
        self.collectors[(step, bucket)] = coll
        for key in [k for k in self.early if k[0] < step - 1]:  # steps that are over: never collected
            stale = self.early.pop(key)
            self.discarded["unexpected"] += sum(len(a.length) for a in stale)
            self.early_bytes -= sum(a.nbytes for a in stale)
        for a in self.early.pop((step, bucket), []):
            self.early_bytes -= a.nbytes
            coll.add(a)
        return coll

    def collect(self, coll: Collector, step_timeout_s: float) -> Collector:
        """Receive until the collector is complete or its deadline passed. The deadline runs
        from the first packet, or, when none came, from the moment every peer has said on its
        stream that it sent them (`sent_to_us`): those packets are lost or late, as after a
        first packet. Without that word it waits up to the step timeout."""
        while not coll.complete:
            now = time.monotonic()
            if coll.expired(now):
                break
            if coll.first is None and all(self.sent_to_us.get(a, (-1, -1)) >= (coll.step, coll.bucket)
                                          for a in coll.ranks.values()):
                coll.first = now
            if coll.first is None and now - coll.opened > step_timeout_s:
                names = ", ".join(self.name_of(a) for a in coll.ranks.values())
                raise ProtocolError(f"no gradient packets of step {coll.step} from {names} "
                                    f"within {step_timeout_s:g} s")
            self.pump()
        del self.collectors[(coll.step, coll.bucket)]
        self.done_steps.add((coll.step, coll.bucket))
        return coll

    def drain(self, seconds: float) -> None:
        """Keep answering (retransmitted chunks, late packets) for a while, or until BYE."""
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.bye:
            self.pump(0.02)

    def flush_broadcasts(self) -> None:
        while self.broadcasts:
            self.pump()
