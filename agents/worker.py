"""A training worker.

Per step: take the step's parameters (delivered reliably), compute the gradient of this
rank's batch, encode it with the run's codec and send it with the trimmable DSCP.
- topology `ps`: the whole gradient goes to the ps, which returns the next parameters.
- topology `sharded`: each worker owns 1/N of the coordinates: every shard goes to its
  owner (all-to-all reduce over trimmable packets), the owner averages and steps its
  shard, and the shards are all-gathered reliably.
Writes metrics.csv, truth/*.npy (the exact gradient of every `truth_every`-th step),
layout.json, final.json (parameter checksum, test accuracy) and, when sharded,
packets.csv into --out.

    python -m agents.worker --config agent.json --rank 0 --out /var/tmp/trimlab/run/w1
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from agents import protocol as P
from agents import workloads as W
from agents.transport import Sender
from testbed import wire

METRIC_FIELDS = ("step", "t", "loss", "grad_norm", "packets", "bytes", "encode_ms", "wait_ms")


class Worker:
    def __init__(self, cfg: dict, rank: int, out: Path):
        self.cfg, self.rank, self.out = cfg, rank, out
        (out / "truth").mkdir(parents=True, exist_ok=True)
        self.t, self.to = cfg["transport"], cfg["timeouts"]
        self.wl = W.build(cfg["workload"], cfg["seed"])
        self.params = W.flat_params(self.wl.model)
        self.numel = self.params.numel()
        self.world = len(cfg["workers"])
        self.me = cfg["workers"][rank]
        self.addrs = {r: w["addr"] for r, w in enumerate(cfg["workers"])}
        self.mlog = P.MetricsLog(out / "metrics.csv", METRIC_FIELDS)
        self.t0 = time.monotonic()

    def sender(self, dst: str) -> Sender:
        return Sender(dst, self.t["port"], self.t["dscp"], rate_bps=self.t.get("pacing_bps"),
                      bind=self.me["addr"])

    def gradient(self, step: int):
        """Loss and exact flat gradient of this rank's batch at the current parameters."""
        W.set_flat_params(self.wl.model, self.params)
        x, y = self.wl.batch(self.cfg["seed"], self.rank, self.world, step, self.cfg["workload"]["batch"])
        self.wl.model.zero_grad(set_to_none=True)
        loss = self.wl.loss(x, y)
        loss.backward()
        g = W.flat_grad(self.wl.model)
        if step % self.cfg["truth_every"] == 0:
            np.save(self.out / "truth" / f"step{step:06d}-rank{self.rank}.npy", g.numpy())
        return loss.item(), g

    def send(self, sender: Sender, grad, step: int, bucket: int) -> tuple[int, int, float]:
        c = self.cfg["codec"]
        e0 = time.monotonic()
        payloads = wire.packetize(grad, self.node.codec, self.cfg["mtu"], c["coords"], c["span"],
                                  wire.PacketIds(self.cfg["job"], step, self.rank, bucket),
                                  self.cfg["seed"], self.t["ipv6"])
        enc = time.monotonic() - e0
        sender.send_all(payloads)
        return len(payloads), sum(map(len, payloads)), enc

    def record(self, step: int, loss: float, grad, packets: int, nbytes: int, enc: float, wait: float) -> None:
        self.mlog.write(step=step, t=round(time.monotonic() - self.t0, 4), loss=round(loss, 6),
                        grad_norm=round(float(grad.norm()), 6), packets=packets, bytes=nbytes,
                        encode_ms=round(enc * 1e3, 2), wait_ms=round(wait * 1e3, 2))
        P.log_event(event="step", role="worker", rank=self.rank, step=step, loss=round(loss, 5))

    def timeout(self, step: int) -> float:
        return self.to["startup_s"] if step == 0 else self.to["params_s"]

    # topology ps
    def run_ps(self) -> None:
        ps = self.cfg["ps"]["addr"]
        self.node = P.Node(self.cfg, self.me["addr"], {ps: self.cfg["ps"]["name"]}, receive_gradients=False)
        tx = self.sender(ps)
        for step in range(self.cfg["steps"]):
            w0 = time.monotonic()
            self.params = self.node.wait_params(ps, step, 0, self.numel, self.timeout(step))
            wait = time.monotonic() - w0
            loss, g = self.gradient(step)
            n, nbytes, enc = self.send(tx, g, step, 0)
            self.record(step, loss, g, n, nbytes, enc, wait)
        self.params = self.node.wait_params(ps, self.cfg["steps"], 0, self.numel, self.to["params_s"])
        self.node.drain(2.0)  # re-acknowledge until the ps says BYE

    # topology sharded
    def run_sharded(self) -> None:
        bounds = P.shard_bounds(self.numel, self.world)
        lo, hi = bounds[self.rank]
        others = {r: a for r, a in self.addrs.items() if r != self.rank}
        self.node = P.Node(self.cfg, self.me["addr"],
                           {w["addr"]: w["name"] for r, w in enumerate(self.cfg["workers"]) if r != self.rank},
                           receive_gradients=True)
        senders = {r: self.sender(a) for r, a in others.items()}
        opt = W.FlatSGD(self.cfg["workload"]["lr"], self.cfg["workload"].get("momentum", 0.0))
        missed = P.MissedSteps(self.node, self.cfg["max_missed_steps"])
        plog = P.PacketLog(self.out / "packets.csv")
        deadline = self.t["deadline_ms"] / 1e3
        steps = self.cfg["steps"]
        try:
            for step in range(steps + 1):
                coll = self.node.expect(step, self.rank, others, hi - lo, deadline) if others and step < steps else None
                w0 = time.monotonic()
                self.node.broadcast(step, self.rank, self.params[lo:hi], list(others.values()),
                                    give_up_s=self.to["startup_s"] if step == 0 else self.to["give_up_s"])
                for r, a in others.items():  # all-gather: everyone's shard of this step
                    s_lo, s_hi = bounds[r]
                    self.params[s_lo:s_hi] = self.node.wait_params(a, step, r, s_hi - s_lo, self.timeout(step))
                wait = time.monotonic() - w0
                if step == steps:
                    break
                loss, g = self.gradient(step)
                n = nbytes = 0
                enc = 0.0
                for r, tx in senders.items():
                    s_lo, s_hi = bounds[r]
                    pn, pb, pe = self.send(tx, g[s_lo:s_hi], step, r)
                    n, nbytes, enc = n + pn, nbytes + pb, enc + pe
                if coll is None:
                    mean = g[lo:hi]
                else:
                    self.node.collect(coll, self.timeout(step) if step == 0 else self.to["step_s"])
                    red = coll.reduce(local=g[lo:hi])
                    plog.write(coll.rows)
                    missed.check(coll, red)
                    mean = red.mean
                opt.step(self.params[lo:hi], mean)
                self.record(step, loss, g, n, nbytes, enc, wait)
            self.node.flush_broadcasts()
            self.node.drain(1.0)
        finally:
            plog.close()

    def run(self) -> dict:
        sharded = self.cfg["topology"] == "sharded"
        (self.out / "layout.json").write_text(json.dumps({
            "numel": self.numel, "rank": self.rank, "topology": self.cfg["topology"],
            "buckets": ({r: list(b) for r, b in enumerate(P.shard_bounds(self.numel, self.world))}
                        if sharded else {0: [0, self.numel]}),
        }, indent=2) + "\n")
        P.log_event(event="start", role="worker", rank=self.rank, numel=self.numel)
        try:
            self.run_sharded() if sharded else self.run_ps()
        finally:
            self.mlog.close()
        W.set_flat_params(self.wl.model, self.params)
        loss, acc = self.wl.evaluate()
        final = {"role": "worker", "rank": self.rank, "steps": self.cfg["steps"],
                 "checksum": W.checksum(self.params), "test_loss": loss, "test_acc": acc,
                 "wall_s": time.monotonic() - self.t0, "discarded": dict(self.node.discarded)}
        (self.out / "final.json").write_text(json.dumps(final, indent=2) + "\n")
        P.log_event(event="done", role="worker", rank=self.rank, checksum=final["checksum"], test_acc=acc)
        return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m agents.worker", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="agent configuration (JSON, written by trimlab run)")
    ap.add_argument("--rank", required=True, type=int, help="this worker's rank (its index in the config)")
    ap.add_argument("--out", required=True, type=Path, help="directory for metrics, truth and final.json")
    a = ap.parse_args(argv)
    P.install_signal_exit()
    cfg = P.load_config(a.config)
    if not 0 <= a.rank < len(cfg["workers"]):
        print(f"worker: --rank {a.rank}: the config has ranks 0..{len(cfg['workers']) - 1}", file=sys.stderr)
        return 2
    try:
        Worker(cfg, a.rank, a.out).run()
    except P.ProtocolError as exc:
        print(f"worker {a.rank}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
