"""The parameter server (topology `ps`: N workers → 1 ps, an incast at the ps's port).

Per step: send the parameters reliably on the control class, receive every worker's
gradient packets until all arrived or the deadline passed, decode trimmed packets at the
precision that survived, average per coordinate over the contributions that arrived, step
the optimizer. Writes packets.csv (one row per gradient datagram received), steps.csv and
final.json into --out.

    python -m trimlab.agents.ps --config agent.json --out /var/tmp/trimlab/run/ps1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from trimlab import rundir
from trimlab.agents import logs
from trimlab.agents import workloads as W
from trimlab.agents.failure import MissedSteps, ProtocolError
from trimlab.agents.node import Node
from trimlab.agents.transport import hold_heap
from trimlab.config import STEP_FIELDS, AgentConfig
from trimlab.errors import SpecError


def run(cfg: AgentConfig, out: Path) -> rundir.Final:
    out.mkdir(parents=True, exist_ok=True)
    t, to = cfg.transport, cfg.timeouts
    wl = W.build(cfg.workload, cfg.seed)
    params = W.flat_params(wl.model)
    numel = params.numel()
    workers = {rank: w.addr for rank, w in enumerate(cfg.workers)}
    dests = list(workers.values())
    node = Node(cfg, bind=cfg.ps.addr, peers={w.addr: w.name for w in cfg.workers}, receive_gradients=True)
    opt = W.FlatSGD(cfg.workload.lr, cfg.workload.momentum)
    missed = MissedSteps(node.ctx, cfg.max_missed_steps)
    plog = logs.PacketLog(out / rundir.PACKET_LOG)
    slog = logs.MetricsLog(out / rundir.STEPS, STEP_FIELDS)
    steps, eval_every = cfg.steps, cfg.eval_every
    deadline = t.deadline_ms / 1e3
    t0 = time.monotonic()
    totals = {"received": 0, "trimmed": 0, "missing": 0, "expected": 0}
    try:
        logs.log_event(event="start", role="ps", numel=numel, workers=len(workers))
        for step in range(steps):
            coll = node.expect(step, 0, workers, numel, deadline)
            bc = node.broadcast(step, 0, params, dests, give_up_s=to.startup_s if step == 0 else to.give_up_s)
            if step == 0:  # start barrier: every worker is up and holds the first parameters
                while not bc.done:
                    node.pump()
                if coll.first is not None:  # the deadline runs from the barrier, not before
                    coll.first = time.monotonic()
            w0 = time.monotonic()
            node.collect(coll, to.startup_s if step == 0 else to.step_s)
            r0 = time.monotonic()
            red = coll.reduce()
            plog.write(coll.rows)
            missed.check(coll, red)
            opt.step(params, red.mean)
            row = dict(step=step, t=round(time.monotonic() - t0, 4), wait_ms=round((r0 - w0) * 1e3, 2),
                       reduce_ms=round((time.monotonic() - r0) * 1e3, 2), received=red.packets,
                       expected=red.expected, trimmed=red.trimmed, missing=red.missing,
                       min_contributors=red.min_contributors, retransmits=bc.retransmits,
                       test_loss="", test_acc="")
            for k, v in (("received", red.packets), ("trimmed", red.trimmed),
                         ("missing", red.missing), ("expected", red.expected)):
                totals[k] += v
            if step % eval_every == 0 or step == steps - 1:
                W.set_flat_params(wl.model, params)
                row["test_loss"], row["test_acc"] = (round(v, 5) for v in wl.evaluate())
            slog.write(**row)
            logs.log_event(event="step", role="ps", **{k: row[k] for k in
                           ("step", "received", "expected", "trimmed", "missing", "test_acc")})
        node.broadcast(steps, 0, params, dests, give_up_s=to.give_up_s)
        node.flush_broadcasts()  # every worker holds the final parameters
        node.bye_all(dests)
        W.set_flat_params(wl.model, params)
        loss, acc = wl.evaluate()
        final = rundir.Final(role="ps", steps=steps, checksum=W.checksum(params), test_loss=loss, test_acc=acc,
                             numel=numel, wall_s=time.monotonic() - t0, discarded=dict(node.discarded), **totals)
        final.write(out)
        logs.log_event(event="done", role="ps", test_acc=acc, checksum=final.checksum)
        return final
    finally:
        plog.close()
        slog.close()
        node.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.agents.ps", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="agent configuration (JSON, written by trimlab run)")
    ap.add_argument("--out", required=True, type=Path, help="directory for packets.csv, steps.csv, final.json")
    a = ap.parse_args(argv)
    logs.install_signal_exit()
    hold_heap()
    try:
        cfg = AgentConfig.read(a.config)
    except SpecError as exc:
        print(f"ps: {exc}", file=sys.stderr)
        return 2
    try:
        run(cfg, a.out)
    except ProtocolError as exc:
        print(f"ps: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
