"""The training protocol shared by the ps and the workers.

Two UDP ports per host on the data network:
- `port` (47000): gradient packets (the trimlab wire format, trimmable DSCP). A
  `Collector` gathers one (step, bucket) from the expected ranks until every packet
  arrived or the deadline passed, then decodes each rank's packets at whatever precision
  arrived and averages per coordinate over the contributions that arrived.
- `port + 1`: parameters, on the non-trimmable control DSCP, delivered reliably: a
  `Broadcast` cuts a parameter shard into chunks and retransmits what a receiver has not
  acknowledged (selective ACK bitmaps) every RTO, so every worker ends each step with
  bit-identical parameters. A receiver acknowledges every chunk it sees, again if it is a
  duplicate, so a lost ACK only costs a retransmission.

A `Node` owns both sockets and does all receiving. It accepts only packets of its job from
the rack's known data addresses, bounds what a step may hold, and counts (never raises on)
whatever it discards.
"""

from __future__ import annotations

import collections
import csv
import json
import select
import struct
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from agents.transport import Datagram, Receiver
from testbed import wire
from testbed.errors import TrimlabError

PARAMS, ACK, BYE = 1, 2, 3
CTRL_VERSION = 1
# kind, version, job, step, shard, first (chunk index | first chunk acked), count
CTRL = struct.Struct("!BBHIHHH")
MAX_ACK_CHUNKS = 8192  # one ACK covers up to this many chunks (a 1 KiB bitmap)
PACKET_LOG_FIELDS = ("t_ns", "src", "dscp", "step", "rank", "bucket", "span", "packet", "coords",
                     "sent_len", "recv_len", "trimmed", "planes", "status")


class ProtocolError(TrimlabError):
    """A peer stopped answering or a step could not complete: the run fails."""

    exit_code = 1


def log_event(**fields) -> None:
    """One JSON line on stdout: the controller reads these for its progress view."""
    print(json.dumps(fields, separators=(",", ":")), flush=True)


# -- reliable parameters ---------------------------------------------------------------------

def chunk_bytes(mtu: int, ipv6: bool) -> int:
    return (mtu - wire.ip_udp_overhead(ipv6) - CTRL.size) // 4 * 4


class Broadcast:
    """One parameter shard of one step, to every destination, until each acknowledged all."""

    def __init__(self, node: "Node", step: int, shard: int, data: bytes, dests: list[str],
                 rto_s: float = 0.05, give_up_s: float = 10.0):
        size = chunk_bytes(node.mtu, node.ipv6)
        self.node, self.step, self.shard = node, step, shard
        self.chunks = [data[i:i + size] for i in range(0, len(data), size)] or [b""]
        if len(self.chunks) > 0xFFFF:
            raise ProtocolError(f"a parameter shard of {len(data)} bytes needs {len(self.chunks)} "
                                f"chunks; at most 65535 fit the header: use more shards or a larger MTU")
        self.rto_s, self.give_up_s = rto_s, give_up_s
        now = time.monotonic()
        self.pending = {d: set(range(len(self.chunks))) for d in dests}
        self.progress = dict.fromkeys(dests, now)
        self.sent_at = dict.fromkeys(dests, 0.0)
        self.retransmits = 0
        # first transmission chunk-major: every destination completes at about the same time
        for i, chunk in enumerate(self.chunks):
            head = CTRL.pack(PARAMS, CTRL_VERSION, node.job, step, shard, i, len(self.chunks))
            for d in dests:
                node.ctrl.sendto(head + chunk, (d, node.ctrl_port))
        self.sent_at = dict.fromkeys(dests, time.monotonic())

    def _send(self, dest: str) -> None:
        n = len(self.chunks)
        for i in sorted(self.pending[dest]):
            head = CTRL.pack(PARAMS, CTRL_VERSION, self.node.job, self.step, self.shard, i, n)
            self.node.ctrl.sendto(head + self.chunks[i], (dest, self.node.ctrl_port))
        self.sent_at[dest] = time.monotonic()

    def on_ack(self, dest: str, first: int, bitmap: np.ndarray) -> None:
        pending = self.pending.get(dest)
        if not pending:
            return
        acked = {first + int(i) for i in np.flatnonzero(bitmap)}
        if pending & acked:
            pending -= acked
            self.progress[dest] = time.monotonic()

    def poll(self, now: float) -> None:
        for dest, pending in self.pending.items():
            if not pending:
                continue
            if now - self.progress[dest] > self.give_up_s:
                raise ProtocolError(f"{self.node.name_of(dest)} stopped acknowledging the "
                                    f"parameters of step {self.step} (shard {self.shard}) for "
                                    f"{self.give_up_s:g} s")
            if now - self.sent_at[dest] >= self.rto_s:
                self.retransmits += len(pending)
                self._send(dest)

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


# -- gradient collection ----------------------------------------------------------------------

@dataclass
class Reduced:
    mean: torch.Tensor  # averaged gradient, 0 where no contribution arrived
    contributors: torch.Tensor  # (numel,) int: contributions averaged per coordinate
    packets: int
    trimmed: int
    expected: int
    missing: int  # packets never received (lost or after the deadline)
    per_rank: dict[int, int]  # rank -> packets received


class Collector:
    """Gradient packets of one (step, bucket) from the expected ranks."""

    def __init__(self, node: "Node", step: int, bucket: int, ranks: dict[int, str], numel: int,
                 deadline_s: float):
        self.node, self.step, self.bucket, self.ranks, self.numel = node, step, bucket, ranks, numel
        self.ctx = dict(span=node.span, coords=node.coords, seed=node.seed)
        lay = node.codec.layout(numel, _context(node, step, bucket))
        self.expected = sum(b.group.count * b.per_span for b in lay.blocks)
        self.deadline_s = deadline_s
        self.payloads: dict[int, list[bytes]] = {r: [] for r in ranks}
        self.seen: dict[int, set] = {r: set() for r in ranks}
        self.rows: list[list] = []
        self.opened = time.monotonic()
        self.first: float | None = None

    def add(self, d: Datagram, head: wire.Header) -> None:
        status = "accepted"
        key = (head.span, head.packet)
        if key in self.seen[head.rank]:
            status = "duplicate"
        elif len(self.seen[head.rank]) >= self.expected:
            status = "over_budget"
        else:
            self.seen[head.rank].add(key)
            self.payloads[head.rank].append(d.payload)
            self.first = self.first or time.monotonic()
        if status != "accepted":
            self.node.discarded[status] += 1
        self.rows.append([d.time_ns, d.src[0], d.dscp, head.step, head.rank, head.bucket, head.span,
                          head.packet, head.coords, head.length, len(d.payload),
                          int(len(d.payload) < head.length), -1, status])

    @property
    def complete(self) -> bool:
        return all(len(s) >= self.expected for s in self.seen.values())

    def expired(self, now: float) -> bool:
        return self.first is not None and now - self.first > self.deadline_s

    def reduce(self, local: torch.Tensor | None = None) -> Reduced:
        """Decode every rank's packets, average per coordinate over what arrived; `local` is
        an exact contribution that never crossed the network (a shard owner's own)."""
        node = self.node
        total = torch.zeros(self.numel)
        count = torch.zeros(self.numel, dtype=torch.int64)
        if local is not None:
            total += local
            count += 1
        planes: dict[tuple, int] = {}
        trimmed = 0
        for rank, payloads in self.payloads.items():
            if not payloads:
                continue
            dp = wire.depacketize(payloads, node.codec, self.numel,
                                  wire.PacketIds(node.job, self.step, rank, self.bucket), **self.ctx)
            ok = ~dp.decoded.missing
            total[ok] += dp.decoded.tensor[ok]
            count += ok
            trimmed += int(dp.trimmed.sum())
            for s, i, p in zip(dp.packets.span.tolist(), dp.packets.index.tolist(),
                               dp.decoded.stats["planes"].tolist()):
                planes[(rank, s, i)] = p
            for reason, n in dp.discarded.items():
                node.discarded[reason] += n
        for row in self.rows:
            if row[-1] == "accepted":
                row[12] = planes.get((row[4], row[6], row[7]), -1)
        per_rank = {r: len(s) for r, s in self.seen.items()}
        received = sum(per_rank.values())
        return Reduced(total / count.clamp(min=1), count, received, trimmed,
                       self.expected * len(self.ranks), self.expected * len(self.ranks) - received,
                       per_rank)


def _context(node: "Node", step: int, bucket: int):
    from testbed.codec import CodecContext

    return CodecContext(seed=node.seed, step=step, bucket=bucket, span=node.span, coords=node.coords)


# -- the node ---------------------------------------------------------------------------------

class Node:
    """Both sockets of one host, and everything in flight: broadcasts, assemblies, collectors."""

    def __init__(self, cfg: dict, bind: str, peers: dict[str, str], receive_gradients: bool):
        from testbed.codec import get_codec

        t = cfg["transport"]
        self.job, self.seed, self.mtu, self.ipv6 = cfg["job"], cfg["seed"], cfg["mtu"], t["ipv6"]
        self.codec = get_codec(cfg["codec"]["name"], **cfg["codec"]["params"])
        self.span, self.coords = cfg["codec"]["span"], cfg["codec"]["coords"]
        self.port, self.ctrl_port = t["port"], t["port"] + 1
        self.peers = peers  # data address -> host name: the only sources accepted
        self.data = Receiver(bind, self.port) if receive_gradients else None
        self.ctrl = Receiver(bind, self.ctrl_port, dscp=t["control_dscp"])
        self.broadcasts: list[Broadcast] = []
        self.assemblies: dict[tuple, Assembly] = {}
        self.completed: dict[tuple, int] = {}  # (src, step, shard) delivered -> its chunk count
        self.collectors: dict[tuple, Collector] = {}
        self.done_steps: set[tuple] = set()  # (step, bucket) already reduced: late packets
        # packets of a (step, bucket) no collector was opened for yet (a faster peer), kept
        # for it up to a bound; past the bound they are counted as unexpected
        self.early: dict[tuple, list[tuple[Datagram, wire.Header]]] = {}
        self.early_bytes, self.early_max_bytes = 0, 8 << 20
        self.rank_of: dict[str, int] = {}
        self.discarded: collections.Counter = collections.Counter()
        self.last_heard: dict[str, float] = {}  # peer address -> when anything last came from it
        self.bye = False

    def name_of(self, addr: str) -> str:
        return f"{self.peers.get(addr, 'unknown host')} ({addr})"

    # receiving
    def pump(self, timeout: float = 0.01) -> None:
        socks = [s.sock for s in (self.data, self.ctrl) if s is not None]
        ready = select.select(socks, [], [], timeout)[0]
        now = time.monotonic()
        if self.data is not None and self.data.sock in ready:
            for d in self.data.recv_batch(timeout=0):
                self._heard(d, now)
                self._on_gradient(d)
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

    def _heard(self, d: Datagram, now: float) -> None:
        if d.src[0] in self.peers:
            self.last_heard[d.src[0]] = now

    def _on_gradient(self, d: Datagram) -> None:
        src = d.src[0]
        if src not in self.peers:
            self.discarded["unknown_source"] += 1
            return
        try:
            head = wire.parse_header(d.payload)
        except wire.WireError:
            self.discarded["not_trimlab"] += 1
            return
        if head.job != self.job:
            self.discarded["other_job"] += 1
            return
        key = (head.step, head.bucket)
        coll = self.collectors.get(key)
        if coll is None:
            if key in self.done_steps:
                self.discarded["late"] += 1
            elif self.early_bytes + len(d.payload) <= self.early_max_bytes:
                self.early.setdefault(key, []).append((d, head))
                self.early_bytes += len(d.payload)
            else:
                self.discarded["unexpected"] += 1
            return
        if coll.ranks.get(head.rank) != src:
            self.discarded["rank_mismatch"] += 1
            return
        coll.add(d, head)

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
    def broadcast(self, step: int, shard: int, values: torch.Tensor, dests: list[str], **kw) -> Broadcast:
        b = Broadcast(self, step, shard, values.to(torch.float32).contiguous().numpy().tobytes(), dests, **kw)
        self.broadcasts.append(b)
        return b

    def bye_all(self, dests: list[str]) -> None:
        head = CTRL.pack(BYE, CTRL_VERSION, self.job, 0, 0, 0, 0)
        for _ in range(3):
            for d in dests:
                self.ctrl.sendto(head, (d, self.ctrl_port))

    # waiting
    def wait_params(self, src: str, step: int, shard: int, numel: int, timeout_s: float) -> torch.Tensor:
        """The parameter shard `shard` of `step` from `src`, once every chunk arrived."""
        key = (src, step, shard)
        t0 = time.monotonic()
        while True:
            asm = self.assemblies.get(key)
            if asm is not None and asm.complete:
                data = asm.data()
                del self.assemblies[key]
                self.completed[key] = asm.nchunks  # duplicates are still acknowledged
                values = torch.frombuffer(bytearray(data), dtype=torch.float32)
                if values.numel() != numel:
                    raise ProtocolError(f"parameters of step {step} from {self.name_of(src)}: "
                                        f"{values.numel()} values, expected {numel}")
                return values
            if time.monotonic() - t0 > timeout_s:
                raise ProtocolError(f"no parameters of step {step} (shard {shard}) from "
                                    f"{self.name_of(src)} within {timeout_s:g} s")
            self.pump()

    def expect(self, step: int, bucket: int, ranks: dict[int, str], numel: int,
               deadline_s: float) -> Collector:
        coll = Collector(self, step, bucket, ranks, numel, deadline_s)
        self.collectors[(step, bucket)] = coll
        for key in [k for k in self.early if k[0] < step - 1]:  # steps that are over: never collected
            stale = self.early.pop(key)
            self.discarded["unexpected"] += len(stale)
            self.early_bytes -= sum(len(d.payload) for d, _ in stale)
        for d, head in self.early.pop((step, bucket), []):
            self.early_bytes -= len(d.payload)
            if coll.ranks.get(head.rank) != d.src[0]:
                self.discarded["rank_mismatch"] += 1
            else:
                coll.add(d, head)
        return coll

    def collect(self, coll: Collector, step_timeout_s: float) -> Collector:
        """Receive until the collector is complete or its deadline passed."""
        while not coll.complete:
            now = time.monotonic()
            if coll.expired(now):
                break
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


class MissedSteps:
    """A rank that contributed nothing for `limit` steps in a row and has sent nothing at all
    (no late gradient, no acknowledgement) for `silence_s` has stopped: fail the run rather
    than train on without it. A rank that is merely slower than the deadline is not."""

    def __init__(self, node: Node, limit: int, silence_s: float = 3.0):
        self.node, self.limit, self.silence_s = node, limit, silence_s
        self.row: collections.Counter = collections.Counter()

    def check(self, coll: Collector, reduced: Reduced) -> None:
        now = time.monotonic()
        for rank, n in reduced.per_rank.items():
            self.row[rank] = 0 if n else self.row[rank] + 1
            heard = self.node.last_heard.get(coll.ranks[rank], coll.opened)
            if self.row[rank] >= self.limit and now - heard > self.silence_s:
                raise ProtocolError(f"{self.node.name_of(coll.ranks[rank])} (rank {rank}) sent no "
                                    f"gradient packet for {self.limit} steps in a row (last: step "
                                    f"{coll.step}) and nothing at all for {now - heard:.1f} s")


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [lo, hi) ranges; shard k belongs to rank k."""
    edges = [numel * k // shards for k in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


class PacketLog:
    """packets.csv: one row per gradient datagram received, with how it was handled."""

    def __init__(self, path: Path):
        self.f = open(path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(PACKET_LOG_FIELDS)

    def write(self, rows) -> None:
        self.w.writerows(rows)

    def close(self) -> None:
        self.f.close()


class MetricsLog:
    """A CSV with a fixed header, flushed every row (a killed agent keeps what it wrote)."""

    def __init__(self, path: Path, fields: tuple[str, ...]):
        self.fields = fields
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, fields)
        self.w.writeheader()

    def write(self, **row) -> None:
        self.w.writerow(row)
        self.f.flush()

    def close(self) -> None:
        self.f.close()


def load_config(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def install_signal_exit() -> None:
    """SIGTERM ends the agent through its `finally` blocks (logs flushed, files closed)."""
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
