"""A training worker.

Per step: take the step's parameters (delivered reliably), compute the gradient of this
rank's batch, encode it with the run's codec and send it with the trimmable DSCP.
- topology `ps`: the whole gradient goes to the ps, which returns the next parameters.
- topology `sharded`: each worker owns 1/N of the coordinates: the sharded all-reduce
  (trimlab.agents.collective) sends every shard to its owner over trimmable packets, the
  owner averages and steps its shard, and the shards are all-gathered reliably.
Writes metrics.csv, truth/*.npy (the exact gradient of every `truth_every`-th step),
layout.json, final.json (parameter checksum, test accuracy) and, when sharded,
packets.csv into --out.

    python -m trimlab.agents.worker --config agent.json --rank 0 --out /var/tmp/trimlab/run/w1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from trimlab import rundir, wire
from trimlab.agents import logs
from trimlab.agents import workloads as W
from trimlab.agents.collective import ShardedAllReduce, shard_bounds
from trimlab.agents.failure import ProtocolError
from trimlab.agents.node import Node
from trimlab.agents.transport import gradient_sender, hold_heap
from trimlab.config import METRIC_FIELDS, PHASES, AgentConfig
from trimlab.errors import SpecError


class Worker:
    def __init__(self, cfg: AgentConfig, rank: int, out: Path):
        cfg.check_rank(rank)
        self.cfg, self.rank, self.out = cfg, rank, out
        (out / rundir.TRUTH).mkdir(parents=True, exist_ok=True)
        self.wl = W.build(cfg.workload, cfg.seed)
        self.params = W.flat_params(self.wl.model)
        self.numel = self.params.numel()
        self.world = len(cfg.workers)
        self.me = cfg.workers[rank]
        self.mlog = logs.MetricsLog(out / rundir.METRICS, METRIC_FIELDS)
        self.t0 = time.monotonic()
        self.node: Node | None = None

    def gradient(self, step: int):
        """Loss and exact flat gradient of this rank's batch at the current parameters."""
        W.set_flat_params(self.wl.model, self.params)
        x, y = self.wl.batch(self.cfg.seed, self.rank, self.world, step, self.cfg.workload.batch)
        self.wl.model.zero_grad(set_to_none=True)
        loss = self.wl.loss(x, y)
        loss.backward()
        g = W.flat_grad(self.wl.model)
        if self.cfg.truth_every and step % self.cfg.truth_every == 0:
            np.save(self.out / rundir.TRUTH / rundir.truth_file(step, self.rank), g.numpy())
        return loss.item(), g

    def record(self, step: int, loss: float, grad, stats: dict) -> None:
        """One metrics row; `stats` holds packets, bytes and the phases' milliseconds."""
        self.mlog.write(step=step, t=round(time.monotonic() - self.t0, 4), loss=round(loss, 6),
                        grad_norm=round(float(grad.norm()), 6), packets=stats["packets"], bytes=stats["bytes"],
                        **{p: round(stats.get(p, 0.0), 2) for p in PHASES})
        logs.log_event(event="step", role="worker", rank=self.rank, step=step, loss=round(loss, 5))

    # topology ps
    def run_ps(self) -> None:
        cfg, t, to = self.cfg, self.cfg.transport, self.cfg.timeouts
        ps = cfg.ps.addr
        self.node = Node(cfg, self.me.addr, {ps: cfg.ps.name}, receive_gradients=False)
        tx = gradient_sender(t, cfg.mtu, ps, self.me.addr)
        logs.log_event(event="pacing", role="worker", rank=self.rank, rate_bps=t.pacing_bps,
                       paced_by=(tx.paced_by or "user space") if t.pacing_bps else None)
        for step in range(cfg.steps):
            w0 = time.monotonic()
            self.params = self.node.wait_params(ps, step, 0, self.numel, to.startup_s if step == 0 else to.params_s)
            wait = time.monotonic() - w0
            loss, g = self.gradient(step)
            e0 = time.monotonic()
            frames = wire.packetize_frames(g, self.node.codec, cfg.mtu, cfg.codec.coords, cfg.codec.span,
                                           wire.PacketIds(cfg.job, step, self.rank, 0), cfg.seed, t.ipv6)
            s0 = time.monotonic()
            tx.send_frames(frames)
            self.record(step, loss, g, {"packets": len(frames), "bytes": frames.nbytes,
                                        "encode_ms": (s0 - e0) * 1e3, "send_ms": (time.monotonic() - s0) * 1e3,
                                        "gather_ms": wait * 1e3})
        self.params = self.node.wait_params(ps, cfg.steps, 0, self.numel, to.params_s)
        tx.close()  # a shaped sender's class goes (its backlog has left: the ps has every step)
        self.node.drain(2.0)  # re-acknowledge until the ps says BYE

    # topology sharded: the all-gather of step s carries the parameters step s starts from
    # (step 0's is the start barrier: every worker is up and holds the first parameters)
    def run_sharded(self) -> None:
        ar = ShardedAllReduce(self.cfg, self.rank)
        self.node = ar.node
        lo, hi = shard_bounds(self.numel, self.world)[self.rank]
        opt = W.FlatSGD(self.cfg.workload.lr, self.cfg.workload.momentum)
        plog = logs.PacketLog(self.out / rundir.PACKET_LOG)
        steps = self.cfg.steps
        try:
            for step in range(steps + 1):
                coll = ar.expect(step, 0, self.numel) if step < steps else None
                self.params = ar.all_gather(self.params[lo:hi].clone(), step, self.numel)
                if step == steps:
                    break
                loss, g = self.gradient(step)
                mean, rows = ar.reduce_scatter(g, step, 0, coll)
                plog.write(rows)
                opt.step(self.params[lo:hi], mean)
                self.record(step, loss, g, ar.take_stats())
            ar.close()
        finally:
            plog.close()

    def run(self) -> rundir.Final:
        sharded = self.cfg.topology == "sharded"
        rundir.GradientLayout(numel=self.numel, rank=self.rank, topology=self.cfg.topology,
                              buckets=(dict(enumerate(shard_bounds(self.numel, self.world)))
                                       if sharded else {0: (0, self.numel)})).write(self.out)
        logs.log_event(event="start", role="worker", rank=self.rank, numel=self.numel)
        try:
            self.run_sharded() if sharded else self.run_ps()
        finally:
            self.mlog.close()
        W.set_flat_params(self.wl.model, self.params)
        loss, acc = self.wl.evaluate()
        final = rundir.Final(role="worker", rank=self.rank, steps=self.cfg.steps, checksum=W.checksum(self.params),
                             test_loss=loss, test_acc=acc, wall_s=time.monotonic() - self.t0,
                             discarded=dict(self.node.discarded))
        final.write(self.out)
        logs.log_event(event="done", role="worker", rank=self.rank, checksum=final.checksum, test_acc=acc)
        return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.agents.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="agent configuration (JSON, written by trimlab run)")
    ap.add_argument("--rank", required=True, type=int, help="this worker's rank (its index in the config)")
    ap.add_argument("--out", required=True, type=Path, help="directory for metrics, truth and final.json")
    a = ap.parse_args(argv)
    logs.install_signal_exit()
    hold_heap()
    try:
        cfg = AgentConfig.read(a.config)
        cfg.check_rank(a.rank)
    except SpecError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    try:
        Worker(cfg, a.rank, a.out).run()
    except ProtocolError as exc:
        print(f"worker {a.rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
