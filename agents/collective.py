"""One sharded all-reduce over the trimmable transport, used by the sharded worker and by
the DDP hook. Rank k owns the k-th shard of every bucket.

- `reduce_scatter`: every rank sends each owner that owner's shard with the run's codec on
  the trimmable DSCP; the owner decodes what arrived at whatever precision it arrived and
  averages per coordinate over the contributions that arrived (its own is exact).
- `all_gather`: each owner sends a shard-sized tensor to every other rank on the
  all-gather streams (trimlab.agents.stream: TCP on the control class; the averaged
  gradient for the hook, its updated parameters for the worker), so every rank ends with
  identical values.

Owner k's shard of bucket i travels as wire bucket i * world + k.
"""

from __future__ import annotations

import time

import torch

from trimlab import wire
from trimlab.agents.collect import Collector
from trimlab.agents.failure import MissedSteps, ProtocolError
from trimlab.agents.node import Node
from trimlab.agents.stream import Mesh
from trimlab.agents.transport import gradient_sender
from trimlab.codec import CodecContext, packing
from trimlab.config import PHASES, AgentConfig


# A shard of at most this many packets is sent by the caller itself: handing it to the
# sender's thread and waiting for it cost more than sending it (bench ddp, 5 k parameters,
# 4 ranks on 2 cores: the send phase 1.8-2.9 ms a step with the thread, 0.4-0.8 without)
INLINE_FRAMES = 64


def shard_bounds(numel: int, shards: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal [lo, hi) ranges; shard k belongs to rank k."""
    edges = [numel * k // shards for k in range(shards + 1)]
    return list(zip(edges[:-1], edges[1:]))


class ShardedAllReduce:
    """The sockets of one rank and the two halves of the all-reduce."""

    def __init__(self, cfg: AgentConfig, rank: int):
        cfg.check_rank(rank)
        self.cfg, self.rank, self.world = cfg, rank, len(cfg.workers)
        me = cfg.workers[rank].addr
        self.others = {r: w.addr for r, w in enumerate(cfg.workers) if r != rank}
        self.node = Node(cfg, me, {w.addr: w.name for r, w in enumerate(cfg.workers) if r != rank},
                         receive_gradients=True)
        t = cfg.transport
        if self.others:
            self.node.mesh = Mesh(cfg.job, rank, {r: w.addr for r, w in enumerate(cfg.workers)}, t.stream_port,
                                  t.control_dscp, t.ipv6, self.node.name_of, self.node.sent_to_us,
                                  self.node.discarded)
        self.senders = {r: gradient_sender(t, cfg.mtu, a, me, r) for r, a in self.others.items()}
        self.deadline_s = t.deadline_ms / 1e3
        self.missed = MissedSteps(self.node.ctx, cfg.max_missed_steps)
        self.stats = self._zero()

    @staticmethod
    def _zero() -> dict:
        return {"packets": 0, "bytes": 0, **{p: 0.0 for p in PHASES}}

    def _phase(self, name: str, t0: float) -> float:
        now = time.monotonic()
        self.stats[name] += (now - t0) * 1e3
        return now

    def take_stats(self) -> dict:
        """Packets, bytes and the time of each phase (config.PHASES) since the last call."""
        out, self.stats = self.stats, self._zero()
        return out

    def _timeout(self, step: int, which: str) -> float:
        to = self.cfg.timeouts
        return to.startup_s if step == 0 else getattr(to, which)  # step 0: every rank still starting

    def wire_bucket(self, index: int, owner: int) -> int:
        b = index * self.world + owner
        if b >= 1 << 16:
            raise ProtocolError(f"bucket {index} of {self.world} ranks needs wire bucket {b}: the header has "
                                "16 bits; use fewer, larger buckets (DDP's bucket_cap_mb)")
        return b

    def expect(self, step: int, index: int, numel: int) -> Collector | None:
        """Open the collector of this rank's shard (None when it has no shard or no peer):
        open it before peers may send, so nothing of theirs is counted unexpected."""
        lo, hi = shard_bounds(numel, self.world)[self.rank]
        if hi == lo or not self.others:
            return None
        return self.node.expect(step, self.wire_bucket(index, self.rank), self.others, hi - lo, self.deadline_s)

    def reduce_scatter(self, flat: torch.Tensor, step: int, index: int = 0,
                       coll: Collector | None = None) -> tuple[torch.Tensor, dict]:
        """This rank's shard of the mean of `flat` over all ranks, and the packet-log rows of
        what it received. `coll` is the collector `expect` opened, if it was opened early.
        Each owner is told on its stream once its packets have left (`Mesh.mark_sent`): a
        bucket lost whole then costs its receiver the deadline, not the step timeout, even
        when every rank lost the others' (no rank's later message could say so: each
        waits for the others' packets before it all-gathers)."""
        bounds = shard_bounds(flat.numel(), self.world)
        lo, hi = bounds[self.rank]
        coll = coll or self.expect(step, index, flat.numel())
        c = self.cfg.codec
        for owner, tx in self.senders.items():
            s_lo, s_hi = bounds[owner]
            if s_hi == s_lo:  # a bucket smaller than the world leaves some ranks no shard
                continue
            t = time.monotonic()
            frames = wire.packetize_frames(flat[s_lo:s_hi], self.node.codec, self.cfg.mtu, c.coords, c.span,
                                           wire.PacketIds(self.cfg.job, step, self.rank,
                                                          self.wire_bucket(index, owner)),
                                           self.cfg.seed, self.cfg.transport.ipv6)
            t = self._phase("encode_ms", t)
            if len(frames) <= INLINE_FRAMES:
                tx.send_frames(frames)
            else:
                tx.send_frames_later(frames)  # sent while the next owner's shard is encoded
            self._phase("send_ms", t)
            self.stats["packets"] += len(frames)
            self.stats["bytes"] += frames.nbytes
        t = time.monotonic()
        for owner, tx in self.senders.items():
            tx.wait_sent()
            s_lo, s_hi = bounds[owner]
            if s_hi > s_lo and self.node.mesh.connected:  # (connected at the first all-gather)
                self.node.mesh.mark_sent(owner, step, self.wire_bucket(index, owner))
        self._phase("send_ms", t)
        if coll is None:
            return flat[lo:hi], {}
        t = time.monotonic()
        self.node.collect(coll, self._timeout(step, "step_s"))
        t = self._phase("wait_ms", t)
        red = coll.reduce(local=flat[lo:hi])
        self._phase("decode_ms", t)
        self.missed.check(coll, red)
        return red.mean, coll.rows

    def all_gather(self, shard: torch.Tensor, step: int, numel: int, index: int = 0,
                   compress: bool = False) -> torch.Tensor:
        """Every owner's shard of a `numel`-long tensor; this rank contributes `shard`.
        With `compress`, a shard travels as the codec's untrimmed packets where that is
        smaller than float32 (`gathered_compressed`); every rank, the owner included, then
        holds the shard as decoded from those bytes, so all end with identical values."""
        w0 = time.monotonic()
        bounds = shard_bounds(numel, self.world)
        lo, hi = bounds[self.rank]
        out = torch.empty(numel, dtype=torch.float32)
        own = self.wire_bucket(index, self.rank)
        data: torch.Tensor | bytes = shard
        if compress and hi > lo and self.gathered_compressed(hi - lo):
            ctx = self._gather_ctx(step, own)
            packets = self.node.codec.encode(shard, ctx)
            data = packing.pack(packets)
            shard = self.node.codec.decode(packets, ctx, hi - lo).tensor  # what the others will hold
        if self.others and not self.node.mesh.connected:  # the first all-gather: every rank is up by now
            self.node.mesh.connect(self._timeout(step, "params_s"))
            self.node.wait_stream_peers(self._timeout(step, "params_s"))
        if hi > lo:
            for r in self.others:
                self.node.mesh.send(r, step, own, data if isinstance(data, bytes)
                                    else data.to(torch.float32).contiguous().numpy().tobytes())
        out[lo:hi] = shard
        for owner, addr in self.others.items():
            s_lo, s_hi = bounds[owner]
            if s_hi == s_lo:
                continue
            b, timeout = self.wire_bucket(index, owner), self._timeout(step, "params_s")
            got = self.node.wait_streamed(addr, step, b, timeout)
            if compress and self.gathered_compressed(s_hi - s_lo):
                ctx = self._gather_ctx(step, b)
                out[s_lo:s_hi] = self.node.codec.decode(packing.unpack(self.node.codec, got, ctx, s_hi - s_lo),
                                                        ctx, s_hi - s_lo).tensor
            else:
                if len(got) != 4 * (s_hi - s_lo):
                    raise ProtocolError(f"all-gather of step {step} from {self.node.name_of(addr)}: "
                                        f"{len(got) // 4} values, expected {s_hi - s_lo}")
                out[s_lo:s_hi] = torch.frombuffer(got, dtype=torch.float32)
        # the kernel has our shard: no peer waits for this rank's next pump
        self.node.flush_streams(self._timeout(step, "params_s"))
        self._phase("gather_ms", w0)
        return out

    def _gather_ctx(self, step: int, bucket: int) -> CodecContext:
        c = self.cfg.codec
        return CodecContext(seed=self.cfg.seed, step=step, bucket=bucket, span=c.span, coords=c.coords)

    def gathered_compressed(self, numel: int) -> bool:
        """Whether a shard of `numel` values is all-gathered as codec packets: only where
        they are smaller than the float32 values (embedded: about half; sign_tail: larger)."""
        return packing.packed_size(self.node.codec, numel, self._gather_ctx(0, 0)) < 4 * numel

    def close(self) -> None:
        """Deliver what is still queued, then end the streams once every peer has ended its
        (closing with a peer's bytes unread would reset the connection under them)."""
        if self.node.mesh is not None:
            try:
                self.node.close_streams(self.cfg.timeouts.give_up_s)
            except ProtocolError:
                pass  # a peer that already left has everything it needed
        for tx in self.senders.values():
            tx.close()
        self.node.close()
