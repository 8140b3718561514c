"""`trimlab bench transport`: gradient packets per second through the virtual switch,
ours against `bench/blast.c` (sendmmsg, no encoding) on the same path, in the same run.

- send: a worker-shaped sender (`python -m trimlab.bench.transport_rate send`) encodes 1 Mi
  coordinates a step with the run's codec (embedded, B filling the MTU: `--mtu`, 1500 or
  jumbo frames up to 9000) and sends them
  through `agents.transport.Sender` (`send_frames`: UDP GSO runs straight from the
  frames array); the rate is what ps1's NIC received during the sender's own timed loop
  (it says ready once python, torch and the codec are warm: start-up is not timed).
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
  Like the sender, the ps says ready once warm (a few buckets decoded: the codec's
  caches and the heap its steps' buffers come from).
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


def send(cfg: AgentConfig, seconds: float, encode: bool, go=None, steps: int | None = None,
         overlap: bool = False) -> dict:
    """Steps of NUMEL coordinates to the ps until `seconds` pass (or `steps` are sent); with
    `encode`, each step is encoded anew (a worker's work), else one step's payloads are
    replayed; with `overlap`, a step is encoded while the one before is sent (the sender's
    own thread), as a worker does with successive buckets. With `go` (a file), say ready
    and wait for a line on it first, so that start-up is not timed."""
    if overlap and not encode:
        raise ValueError("overlap needs encode: a replay rewrites its one array while it is in flight")
    codec = get_codec(cfg.codec.name)
    grad = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    tx = Sender(cfg.ps.addr, cfg.transport.port, cfg.transport.dscp, bind=cfg.workers[0].addr)
    ids = lambda step: wire.PacketIds(cfg.job, step, 0, 0)  # noqa: E731
    frames = wire.packetize_frames(grad, codec, cfg.mtu, cfg.codec.coords, cfg.codec.span, ids(0), cfg.seed)
    if go is not None:  # started and warmed up: the clock starts when the bench says go
        print(json.dumps({"ready": True}), flush=True)
        go.readline()
    t0, step, sent = time.monotonic(), 0, 0
    while (time.monotonic() - t0 < seconds) if steps is None else step < steps:
        if encode:
            frames = wire.packetize_frames(grad, codec, cfg.mtu, cfg.codec.coords, cfg.codec.span, ids(step),
                                           cfg.seed)
        elif step:  # the same bodies under this step's header (bytes 6..9), without encoding
            frames.data[:, 6:10] = np.frombuffer(step.to_bytes(4, "big"), dtype=np.uint8)
        if overlap:
            tx.send_frames_later(frames)  # (a new array each step: the one in flight stays as it is)
        else:
            tx.send_frames(frames)
        sent += len(frames)
        step += 1
    tx.wait_sent()
    return {"sent": sent, "steps": step, "seconds": time.monotonic() - t0}


def receive(cfg: AgentConfig, steps: int) -> dict:
    """Collect and decode `steps` steps, one after the other, from a socket buffer deep
    enough for all of them (so that only the ps's own pace sets the rate)."""
    node = Node(cfg, cfg.ps.addr, {cfg.workers[0].addr: "w1"}, receive_gradients=True)
    node.data.sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 1 << 30)
    # warm, as the sender is before its clock starts: a few buckets decoded build the
    # codec's caches and the heap that a step's buffers come from (start-up is not timed)
    ctx = CodecContext(seed=cfg.seed, step=0, bucket=0, span=cfg.codec.span, coords=cfg.codec.coords)
    for _ in range(3):
        node.codec.decode(node.codec.encode(torch.randn(NUMEL), ctx), ctx, NUMEL)
    print(json.dumps({"ready": True}), flush=True)
    decoded, trimmed, lost, t_first = 0, 0, 0, None
    for step in range(steps):
        coll = node.expect(step, 0, {0: cfg.workers[0].addr}, NUMEL, cfg.transport.deadline_ms / 1e3)
        node.collect(coll, step_timeout_s=60.0)
        red = coll.reduce()
        t_first = t_first or coll.first
        decoded += red.packets
        trimmed += red.trimmed
        lost += red.missing
    seconds = time.monotonic() - t_first if t_first is not None else 0.0
    node.close()
    return {"decoded": decoded, "trimmed": trimmed, "lost": lost, "seconds": seconds, "steps": steps}


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

        def agent(ns: str, *argv: str) -> subprocess.Popen:
            return rundir.spawn(procs, ["ip", "netns", "exec", ns, sys.executable, "-m", "trimlab.bench.transport_rate",
                                        *argv, "--config", cfg.model_dump_json()], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

        def result(p: subprocess.Popen) -> dict:
            out, err = p.communicate(timeout=300)
            if p.returncode:
                raise RuntimeError(f"bench transport agent failed: {err.strip()[-800:]}")
            return json.loads(out)

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
        for trimmed in (False, True):
            sw.apply({"TRIMLAB_INJECT": {"GLOBAL": {"probability": "1" if trimmed else "0", "action": "trim"}}})
            rows, lost = {"blast_pps": [], "send_pps": [], "send_serial_pps": [], "receive_decode_pps": []}, 0
            for _ in range(rounds):
                rows["blast_pps"].append(blast_pps())
                for key, extra in (("send_pps", ["--overlap"]), ("send_serial_pps", [])):
                    tx = agent(w1.ns, "send", "--seconds", str(seconds), "--encode", "--wait", *extra)
                    assert json.loads(tx.stdout.readline()).get("ready")  # python and torch are up
                    before = _rx_packets(ps.ns)
                    tx.stdin.write("go\n")
                    tx.stdin.flush()
                    r = result(tx)
                    rows[key].append((_rx_packets(ps.ns) - before) / r["seconds"])
                rx = agent(ps.ns, "receive", "--steps", str(BURST_STEPS))
                assert json.loads(rx.stdout.readline()).get("ready")  # bound: it may be sent to
                result(agent(w1.ns, "send", "--steps", str(BURST_STEPS)))
                r = result(rx)
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
    ap = argparse.ArgumentParser(prog="python -m trimlab.bench.transport_rate", description="the bench's agents")
    ap.add_argument("role", choices=["send", "receive"])
    ap.add_argument("--config", required=True, help="AgentConfig as JSON")
    ap.add_argument("--seconds", type=float, default=1.0, help="send: for this long")
    ap.add_argument("--steps", type=int, help="send: this many steps (instead of --seconds); receive: this many")
    ap.add_argument("--encode", action="store_true", help="encode every step (else replay one)")
    ap.add_argument("--wait", action="store_true", help="send: say ready, start on a line on stdin")
    ap.add_argument("--overlap", action="store_true", help="send: encode a step while the one before is sent")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    hold_heap()  # as the agents do
    cfg = AgentConfig.model_validate_json(a.config)
    print(json.dumps(send(cfg, a.seconds, a.encode, sys.stdin if a.wait else None, a.steps, a.overlap)
                     if a.role == "send"
                     else receive(cfg, a.steps or BURST_STEPS)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
