"""`trimlab bench transport`: gradient packets per second through the virtual switch,
ours against `bench/blast.c` (sendmmsg, no encoding) on the same path, in the same run.

- send: a worker-shaped sender (`python -m trimlab.bench.transport_rate send`) encodes 1 Mi
  coordinates a step with the run's codec (embedded, B filling the MTU: `--mtu`, 1500 or
  jumbo frames up to 9000) and sends them
  through `agents.transport.Sender` (`send_frames`: UDP GSO runs straight from the
  frames array); the rate is what ps1's NIC received during the sender's own timed loop
  (one process serves every timed loop of the bench, warm before the first one: python,
  torch, the codec and its frames; start-up is not timed).
  `send`: each step encoded while the one before is sent (`send_frames_later`, the
  sender's own thread), as a worker does with successive buckets; `send_serial`: encode,
  then send, one step at a time.
- receive and decode: a burst of BURST_STEPS steps of real trimlab packets (pre-encoded,
  replayed by a sender with no encoding in the loop, as fast as it can: blast's rate) into
  ps1, whose socket buffer is made deep enough to hold the whole burst, so the ps works
  through it at its own pace and loses nothing: what is measured is the ps's rate, not a
  deadline. The ps's collection path (`agents.node.Node`, `Collector`, decode) takes the
  steps one after the other; the rate is packets decoded per second, from the first
  packet's arrival to the last step's decode (`lost` counts any packet the burst lost).
  Like the sender, the ps is one process, warm before its first burst (a few buckets
  decoded: the codec's caches and the heap its steps' buffers come from); its socket is
  bound for each burst only, so that the timed sends meet no socket at the ps.
Both also with every packet trimmed by the switch (deterministic injection, p = 1).
The port rate is far above what the machine pushes, so the limiter never binds. The
ratios are medians of per-round ratios (ours ÷ blast, measured back to back). With jumbo
frames (`--mtu 9000`) a packet carries 4096 coordinates instead of 704: blast's packet
rate hardly changes with size while ours is the codec's, so MTUs compare in coordinates
per second (`*_coords_per_s`), not in the ratio to blast."""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch

from trimlab import rundir, wire
from trimlab.agents.node import Node
from trimlab.agents.transport import Sender, hold_heap
from trimlab.bench.switch import _blaster, _rx_packets
from trimlab.codec import CodecContext, get_codec
from trimlab.config import GRADIENT_PORT, AgentConfig, CodecConfig, HostConfig, TransportConfig, WorkloadConfig
from trimlab.testbed.vrack import rack

NUMEL = 1 << 20
BURST_STEPS = 100  # about 150 k packets, 0.3 s at blast's rate; some 350 MB of socket buffer
SO_RCVBUFFORCE = 33  # socket.h: SO_RCVBUF past net.core.rmem_max (CAP_NET_ADMIN)
JOB = 21


def _cfg(sender: str, receiver: str, mtu: int) -> AgentConfig:
    coords = wire.fill_coords(get_codec("embedded"), mtu, 4096)
    return AgentConfig(name="bench-transport", job=JOB, seed=1, steps=1, mtu=mtu, topology="ps",
                       workload=WorkloadConfig(), codec=CodecConfig(name="embedded", span=4096, coords=coords),
                       transport=TransportConfig(dscp=10, control_dscp=46, deadline_ms=10), ps=HostConfig(name="ps1", addr=receiver),
                       workers=[HostConfig(name="w1", addr=sender)])


class Sending:
    """A worker-shaped sender of NUMEL coordinates a step to the ps, warm (python, torch, the
    codec, its frames) before its first timed loop: one process serves every loop of the
    bench, so that each round times sending, not start-up."""

    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        self.codec = get_codec(cfg.codec.name)
        self.grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
        self.tx = Sender(cfg.ps.addr, cfg.transport.port, cfg.transport.dscp, bind=cfg.workers[0].addr)
        self.replay = self.frames(0)  # a replay's one array: never handed to the sender's thread

    def frames(self, step: int):
        c = self.cfg
        return wire.packetize_frames(self.grad, self.codec, c.mtu, c.codec.coords, c.codec.span,
                                     wire.PacketIds(c.job, step, 0, 0), c.seed)

    def loop(self, seconds: float | None = None, steps: int | None = None, encode: bool = False,
             overlap: bool = False, first_step: int = 0) -> dict:
        """Steps first_step, first_step + 1, ... until `seconds` pass (or `steps` are sent);
        with `encode`, each step is encoded anew (a worker's work), else one step's payloads
        are replayed under each step's header; with `overlap`, a step is encoded while the
        one before is sent (the sender's own thread), as a worker does with successive
        buckets."""
        if overlap and not encode:
            raise ValueError("overlap needs encode: a replay rewrites its one array while it is in flight")
        t0, n, sent = time.monotonic(), 0, 0
        while (time.monotonic() - t0 < seconds) if steps is None else n < steps:
            step = first_step + n
            if encode:
                frames = self.frames(step)
            else:  # the same bodies under this step's header (bytes 6..9), without encoding
                frames = self.replay
                frames.data[:, 6:10] = np.frombuffer(step.to_bytes(4, "big"), dtype=np.uint8)
            if overlap:
                self.tx.send_frames_later(frames)  # (a new array each step: the one in flight stays as it is)
            else:
                self.tx.send_frames(frames)
            sent += len(frames)
            n += 1
        self.tx.wait_sent()
        return {"sent": sent, "steps": n, "seconds": time.monotonic() - t0}


class Receiving:
    """The ps's collection path, warm: a few buckets decoded build the codec's caches and the
    heap that a step's buffers come from, as the sender is warm before its clock starts."""

    def __init__(self, cfg: AgentConfig):
        self.cfg = cfg
        codec = get_codec(cfg.codec.name)
        ctx = CodecContext(seed=cfg.seed, step=0, bucket=0, span=cfg.codec.span, coords=cfg.codec.coords)
        for _ in range(3):
            codec.decode(codec.encode(torch.randn(NUMEL), ctx), ctx, NUMEL)

    def burst(self, steps: int, first_step: int = 0, ready=None) -> dict:
        """Collect and decode steps first_step.. one after the other, from a socket buffer
        deep enough for all of them (so that only the ps's own pace sets the rate). The
        socket is bound for the burst only: between bursts the sender's timed loops meet no
        socket at the ps, as with no ps at all. `ready()` is called once it is bound."""
        cfg = self.cfg
        node = Node(cfg, cfg.ps.addr, {cfg.workers[0].addr: "w1"}, receive_gradients=True)
        try:
            node.data.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1 << 30)
            if ready is not None:
                ready()
            decoded, trimmed, lost, t_first = 0, 0, 0, None
            for step in range(first_step, first_step + steps):
                coll = node.expect(step, 0, {0: cfg.workers[0].addr}, NUMEL, cfg.transport.deadline_ms / 1e3)
                node.collect(coll, step_timeout_s=60.0)
                red = coll.reduce()
                t_first = t_first or coll.first
                decoded += red.packets
                trimmed += red.trimmed
                lost += red.missing
            seconds = time.monotonic() - t_first if t_first is not None else 0.0
        finally:
            node.close()
        return {"decoded": decoded, "trimmed": trimmed, "lost": lost, "seconds": seconds, "steps": steps}


class _Agent:
    """One of the bench's agent processes in a host's namespace: it says ready once warm,
    then answers each request (a JSON line) with a JSON line."""

    def __init__(self, procs: list, ns: str, role: str, cfg: AgentConfig):
        self.p = rundir.spawn(procs, ["ip", "netns", "exec", ns, sys.executable, "-m", "trimlab.bench.transport_rate",
                                      role, "--config", cfg.model_dump_json()], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.role = role
        self.line()  # {"ready": true}: python, torch and the codec are up

    def line(self) -> dict:
        out = self.p.stdout.readline()
        if not out:  # it ended: its error says why
            self.p.stdin.close()
            err = self.p.stderr.read()
            self.p.wait(timeout=60)
            raise RuntimeError(f"bench transport {self.role} agent failed: {err.strip()[-800:]}")
        return json.loads(out)

    def ask(self, **request) -> dict:
        self.p.stdin.write(json.dumps(request) + "\n")
        self.p.stdin.flush()
        return self.line()

    def close(self) -> None:
        self.p.stdin.close()
        if self.p.wait(timeout=60):
            raise RuntimeError(f"bench transport {self.role} agent failed: {self.p.stderr.read().strip()[-800:]}")


def run(quick: bool = False, rack_id: str = "btr", mtu: int = 1500) -> dict:
    seconds, rounds = (1.0, 3) if quick else (3.0, 5)
    st = rack.up(rack.plan(rack_id, 1, 1, 0, "100gbit", mtu, 0), owned=True)
    procs: list[subprocess.Popen] = []
    try:
        sw = st.vswitch()
        w1, ps = st.nic_hosts[0], st.nic_hosts[1]
        sw.apply({"BUFFER_PROFILE": {"deep": {"static_th": str(1 << 30), "packet_discard_action": "trim"}},
                  "BUFFER_QUEUE": {f"{','.join(st.ports)}|0-7": {"profile": "deep"}},
                  "SWITCH_TRIMMING": {"GLOBAL": {"size": "256"}}})
        cfg = _cfg(w1.data_ipv4, ps.data_ipv4, mtu)
        size = len(wire.packetize(torch.zeros(4096), get_codec("embedded"), mtu, cfg.codec.coords)[0])
        exe = _blaster()
        # blast's sink: a socket that never reads (the stack drops at its queue, no ICMP)
        rundir.spawn(procs, ["ip", "netns", "exec", ps.ns, sys.executable, "-c",
                             "import socket,time; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM);"
                             f"s.bind(('0.0.0.0', {GRADIENT_PORT + 2})); time.sleep(3600)"])

        def blast_pps() -> float:
            before, t0 = _rx_packets(ps.ns), time.monotonic()
            subprocess.run(["ip", "netns", "exec", w1.ns, str(exe), ps.data_ipv4, str(GRADIENT_PORT + 2), str(size),
                            str(10 << 2), str(seconds)], capture_output=True, check=True)
            return (_rx_packets(ps.ns) - before) / (time.monotonic() - t0)

        # coordinates a packet carries on average (a span's last packet may be shorter): with
        # jumbo frames a packet carries more of them, so MTUs compare in coordinates per second
        per_packet = NUMEL / len(wire.packetize_frames(torch.zeros(NUMEL), get_codec("embedded"), mtu,
                                                       cfg.codec.coords, cfg.codec.span))
        out: dict = {"bench": "transport", "quick": quick, "rounds": rounds, "seconds": seconds, "numel": NUMEL,
                     "mtu": mtu, "codec": "embedded", "coords": cfg.codec.coords, "payload_bytes": size}
        tx, rx = _Agent(procs, w1.ns, "send", cfg), _Agent(procs, ps.ns, "receive", cfg)
        step = 0  # the steps' numbers go on from burst to burst: each is new to the ps
        for trimmed in (False, True):
            sw.apply({"TRIMLAB_INJECT": {"GLOBAL": {"probability": "1" if trimmed else "0", "action": "trim"}}})
            rows, lost = {"blast_pps": [], "send_pps": [], "send_serial_pps": [], "receive_decode_pps": []}, 0
            for _ in range(rounds):
                rows["blast_pps"].append(blast_pps())
                for key, overlap in (("send_pps", True), ("send_serial_pps", False)):
                    before = _rx_packets(ps.ns)
                    r = tx.ask(seconds=seconds, encode=True, overlap=overlap)
                    rows[key].append((_rx_packets(ps.ns) - before) / r["seconds"])
                assert rx.ask(steps=BURST_STEPS, first_step=step).get("bound")  # it may be sent to
                tx.ask(steps=BURST_STEPS, first_step=step)
                r = rx.line()
                step += BURST_STEPS
                rows["receive_decode_pps"].append(r["decoded"] / max(r["seconds"], 1e-9))
                lost += r["lost"]
            key = "all_trimmed" if trimmed else "untrimmed"
            out[key] = {k: round(statistics.median(v)) for k, v in rows.items()}
            for k in ("send", "send_serial"):
                out[key][f"{k}_over_blast"] = round(statistics.median(
                    s / b for s, b in zip(rows[f"{k}_pps"], rows["blast_pps"])), 3)
            out[key]["receive_decode_over_blast"] = round(statistics.median(
                r / b for r, b in zip(rows["receive_decode_pps"], rows["blast_pps"])), 3)
            out[key]["receive_lost"] = lost  # packets a burst lost (0: the buffer held them all)
            for k in ("send", "receive_decode"):
                out[key][f"{k}_coords_per_s"] = round(out[key][f"{k}_pps"] * per_packet)
        tx.close()
        rx.close()
        out["targets"] = {f"{k}_ge_0.8": all(out[m][k] >= 0.8 for m in ("untrimmed", "all_trimmed"))
                          for k in ("send_over_blast", "receive_decode_over_blast")}
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        rack.down(st)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.bench.transport_rate", description="the bench's agents: "
                                 "each says ready once warm, then answers every JSON request on stdin with a "
                                 "JSON line, until stdin ends")
    ap.add_argument("role", choices=["send", "receive"])
    ap.add_argument("--config", required=True, help="AgentConfig as JSON")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    hold_heap()  # as the agents do
    cfg = AgentConfig.model_validate_json(a.config)
    agent = Sending(cfg) if a.role == "send" else Receiving(cfg)

    def say(obj: dict) -> None:
        print(json.dumps(obj), flush=True)

    say({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        if a.role == "send":  # seconds or steps, encode, overlap, first_step
            say(agent.loop(**request))
        else:  # steps, first_step: says bound, then the burst's result
            say(agent.burst(**request, ready=lambda: say({"bound": True})))
    return 0


if __name__ == "__main__":
    sys.exit(main())
