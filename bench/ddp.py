"""`trimlab bench ddp`: median step time of the same DDP script on the same virtual rack
with trimlab's comm hook and with DDP's own gloo all-reduce, for models of about 5 k, 1 M
and 5 M parameters (the example MLP, wider and deeper), at every listed port rate
(`--rates`) and MTU (`--mtu`), without and with congestion that hits each contender
alike: a UDP flow at 60 % of the port rate into w1's port on the contender's own class
(DSCP 0 for gloo's TCP, whose queue drops; the gradient DSCP for the hook, whose queue
trims). Both move their gradients over the data network through the eBPF switch. Rounds
alternate the two, and the ratios are medians of per-round ratios, so a slow spell of
this shared machine hits both alike. Beside each step: the contender's wire-time bound
(the frame bytes one rank must send, ÷ the port rate; the ports are full duplex and every
rank sends as much as it receives), the compute floor (the same script exchanging
nothing, `--comm local`: on a host with fewer cores than ranks it, not the wire, bounds
a step), how far the hook's final parameters are from all-reduce's when nothing is
trimmed, and the hook's phase times."""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from trimlab import resources, rundir, wire
from trimlab.agents.reliable import CTRL, chunk_bytes
from trimlab.codec import CodecContext, get_codec, packing
from trimlab.config import (
    PHASES,
    TRAFFIC_PORT,
    AgentConfig,
    CodecConfig,
    HostConfig,
    TransportConfig,
    WorkloadConfig,
    parse_rate,
)
from trimlab.spec import load_profile
from trimlab.testbed.targets import Port, get_target
from trimlab.testbed.vrack import rack

SCRIPT = resources.example_ddp_script()
MASTER_PORT = 29600
WORKERS = 4
FLOW_SHARE = 0.6  # the background flow's rate, of the port rate
TCP_IP_LEN = 52  # IPv4 + TCP with timestamps, per segment of gloo's streams
# name: (hidden width, hidden layers) of the example MLP on digits (64 inputs, 10 classes)
MODELS = {"5k": (64, 1), "1M": (1000, 2), "5M": (2200, 2)}
GRADIENT_DSCP = 10


def parameters(width: int, depth: int) -> int:
    sizes = [64] + [width] * depth + [10]
    return sum(a * b + b for a, b in zip(sizes, sizes[1:]))


def _codec_config(mtu: int) -> CodecConfig:
    codec = get_codec("embedded", planes=16)
    return CodecConfig(name="embedded", params={"planes": 16}, span=4096, coords=wire.fill_coords(codec, mtu, 4096))


def _config(st, steps: int, params: int, rate_bps: int) -> AgentConfig:
    workers = [h for h in st.nic_hosts if h.role == "worker"]
    # the deadline leaves room for a whole shard's packets at the port rate, twice over
    inbound_s = params * 2 * 8 / rate_bps
    return AgentConfig(name="bench-ddp", job=11, seed=2, steps=steps, mtu=st.mtu, topology="sharded",
                       workload=WorkloadConfig(kind="ddp", steps=steps),
                       codec=_codec_config(st.mtu),
                       transport=TransportConfig(dscp=GRADIENT_DSCP, control_dscp=46,
                                                 deadline_ms=max(500, int(2e3 * inbound_s))),
                       workers=[HostConfig(name=h.name, addr=h.data_ipv4) for h in workers])


def wire_bytes(params: int, mtu: int, workers: int = WORKERS) -> dict[str, int]:
    """Ethernet frame bytes one rank sends in a step (one bucket of `params`), per contender.
    The hook: its shard of every other rank as gradient packets (reduce-scatter), then its
    averaged shard to every other rank over the reliable channel, as the codec's packets
    packed into chunks (all-gather). gloo: a ring all-reduce, 2(N − 1)/N of the float32
    values, in TCP segments of the MTU."""
    cc = _codec_config(mtu)
    codec = get_codec(cc.name, **cc.params)
    shard = -(-params // workers)
    ctx = CodecContext(seed=0, step=0, bucket=0, span=cc.span, coords=cc.coords)
    n, _ = codec.body_shape(shard, ctx)
    lay = codec.layout(shard, ctx)
    body = sum(b.group.count * b.per_span * codec.body_bytes(b.coords) for b in lay.blocks)
    per_packet = wire.ETH_LEN + wire.ip_udp_overhead() + wire.HEADER_LEN
    scatter = body + n * per_packet
    packed = packing.packed_size(codec, shard, ctx)
    chunks = -(-packed // chunk_bytes(mtu, False))
    gather = packed + chunks * (wire.ETH_LEN + wire.ip_udp_overhead() + CTRL.size)
    ring = 2 * (workers - 1) * shard * 4
    mss = mtu - TCP_IP_LEN
    return {"hook": (workers - 1) * (scatter + gather),
            "allreduce": ring + -(-ring // mss) * (TCP_IP_LEN + wire.ETH_LEN)}


def _train(st, cfg_path: Path, comm: str, steps: int, model: tuple[int, int], out: Path) -> dict:
    """The script on every worker; rank 0's median step time (first 3 steps left out) and
    the final parameters."""
    workers = [h for h in st.nic_hosts if h.role == "worker"]
    procs = []
    for rank, h in enumerate(workers):
        env = os.environ | {"MASTER_ADDR": workers[0].data_ipv4, "MASTER_PORT": str(MASTER_PORT),
                            "RANK": str(rank), "WORLD_SIZE": str(len(workers)), "LOCAL_RANK": "0",
                            "GLOO_SOCKET_IFNAME": "eth1", "TRIMLAB_CONFIG": str(cfg_path),
                            "TRIMLAB_OUT": str(out / f"{comm}-{rank}"),
                            "OMP_NUM_THREADS": "1"}  # 4 ranks share the cores: no oversubscription
        # output to files, not pipes: a rank blocked on a full pipe that is not being read
        # (the ranks are waited for one by one) never reaches the others' barrier
        with open(out / f"{comm}-{rank}.out", "w") as o, open(out / f"{comm}-{rank}.err", "w") as e:
            rundir.spawn(procs, ["ip", "netns", "exec", h.ns, sys.executable, str(SCRIPT), "--steps",
                                 str(steps), "--comm", comm, "--seed", "2", "--width", str(model[0]),
                                 "--depth", str(model[1]), "--save", str(out / f"{comm}-{{rank}}.pt")],
                         env=env, stdout=o, stderr=e)
    try:
        for p in procs:
            p.wait(timeout=900)
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    failed = [f"rank {r}: {(out / f'{comm}-{r}.err').read_text().strip()[-1500:]}"
              for r, p in enumerate(procs) if p.returncode]
    if failed:
        raise RuntimeError(f"ddp_train.py --comm {comm} failed: " + "\n".join(failed))
    steps_of = [[json.loads(ln) for ln in (out / f"{comm}-{r}.out").read_text().splitlines() if '"event": "step"' in ln]
                for r in range(len(procs))]
    times = [e["step_s"] for e in steps_of[0]]
    # the ranks' CPU in a step (first 3 left out) as a share of their cores over rank 0's
    # step: near 1, the step waits for the CPU, not for the wire
    cores = len(os.sched_getaffinity(0))  # the ranks inherit this process's CPUs
    cpu = [sum(r[i]["cpu_s"] for r in steps_of) / (cores * steps_of[0][i]["step_s"])
           for i in range(min(map(len, steps_of))) if steps_of[0][i]["step_s"] > 0][3:]
    result = {"median_step_s": statistics.median(times[3:] or times),
              "cpu_share": round(statistics.median(cpu), 3) if cpu else None,
              "params": torch.cat([v.reshape(-1) for v in torch.load(out / f"{comm}-0.pt").values()])}
    metrics = out / f"{comm}-0" / rundir.METRICS
    if metrics.exists():  # the hook's phases, rank 0, median over steps after the first 3
        rows = list(csv.DictReader(metrics.open()))[3:]
        result["phases_ms"] = {p: round(statistics.median(float(r[p]) for r in rows), 2) for p in PHASES} if rows else {}
    return result


def _flow(st, dscp: int, rate: str, into: list[subprocess.Popen]) -> None:
    w1 = next(h for h in st.nic_hosts if h.role == "worker")
    tr = next(h for h in st.nic_hosts if h.role == "traffic")
    rundir.spawn(into, ["ip", "netns", "exec", tr.ns, sys.executable, "-m", "trimlab.agents.traffic", "send",
                        "--dst", w1.data_ipv4, "--port", str(TRAFFIC_PORT), "--rate", rate, "--dscp", str(dscp)],
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop(flows: list[subprocess.Popen]) -> None:
    while flows:
        flow = flows.pop()
        flow.terminate()
        try:
            flow.wait(10)
        except subprocess.TimeoutExpired:
            flow.kill()
            flow.wait()


def run(quick: bool = False, rack_id: str = "bdd", models: list[str] | None = None,
        rates: list[str] | None = None, mtu: int = 1500) -> dict:
    models = models or (["5k", "1M"] if quick else list(MODELS))
    rates = rates or ["100mbit"]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise ValueError(f"models {unknown}: choose from {', '.join(MODELS)}")
    rounds = 1 if quick else 3
    result: dict = {"bench": "ddp", "quick": quick, "rounds": rounds, "workers": WORKERS, "mtu": mtu,
                    "background": f"UDP at {FLOW_SHARE:.0%} of the port rate into w1's port on the contender's "
                                  f"class (DSCP 0 for gloo, {GRADIENT_DSCP} for the hook)", "rates": {}}
    for rate in rates:
        result["rates"][rate] = _at_rate(rack_id, rate, mtu, models, rounds, quick)
    result["targets"] = _targets(result["rates"])
    return result


def _at_rate(rack_id: str, rate: str, mtu: int, models: list[str], rounds: int, quick: bool) -> dict:
    """Every model on one rack of this port rate."""
    bps = parse_rate(rate)
    flow_rate = f"{max(1, round(FLOW_SHARE * bps / 1e6))}mbit"
    tmp = Path(tempfile.mkdtemp(prefix="trimlab-bench-ddp-"))
    st = rack.up(rack.plan(rack_id, WORKERS, 0, 1, rate, mtu, 0), owned=True)
    flows: list[subprocess.Popen] = []
    try:
        prof = load_profile("default")
        st.vswitch().apply(get_target("vswitch").render(prof, [Port(p) for p in st.ports]).config)
        out: dict = {"rate_bps": bps, "background_rate": flow_rate, "models": {}}
        for name in models:
            model = MODELS[name]
            n = parameters(*model)
            steps = (12 if n < 1e6 else 8) if quick else (40 if n < 1e6 else 20)
            cfg_path = tmp / f"{name}-{rundir.AGENT_CONFIG}"
            _config(st, steps, n, bps).write(cfg_path)
            bound = {k: round(8e3 * v / bps, 2) for k, v in wire_bytes(n, mtu).items()}
            res: dict = {"parameters": n, "steps": steps, "wire_bound_ms": bound}
            floor = [_train(st, cfg_path, "local", steps, model, tmp) for _ in range(rounds)]
            res["compute_floor_ms"] = floor_ms = round(1e3 * statistics.median(f["median_step_s"] for f in floor), 2)
            for congestion in (False, True):
                hook, gloo = [], []
                for _ in range(rounds):
                    for comm, runs, dscp in (("trimlab", hook, GRADIENT_DSCP), ("allreduce", gloo, 0)):
                        if congestion:
                            _flow(st, dscp, flow_rate, flows)
                        try:
                            runs.append(_train(st, cfg_path, comm, steps, model, tmp))
                        finally:
                            _stop(flows)
                key = "with_congestion" if congestion else "no_congestion"
                hook_ms = 1e3 * statistics.median(h["median_step_s"] for h in hook)
                res[key] = {"hook_step_ms": round(hook_ms, 2),
                            "allreduce_step_ms": round(1e3 * statistics.median(g["median_step_s"] for g in gloo), 2),
                            "hook_over_allreduce": round(statistics.median(
                                h["median_step_s"] / g["median_step_s"] for h, g in zip(hook, gloo)), 3),
                            "hook_over_wire_bound": round(hook_ms / bound["hook"], 2) if bound["hook"] else None,
                            # the step's time beyond the compute floor, against the wire's
                            "hook_exchange_over_wire_bound": round((hook_ms - floor_ms) / bound["hook"], 2)
                            if bound["hook"] else None,
                            "hook_phases_ms": hook[-1].get("phases_ms", {}),
                            "cpu_share": {"hook": hook[-1]["cpu_share"], "allreduce": gloo[-1]["cpu_share"]}}
                if not congestion:
                    a, b = hook[-1]["params"], gloo[-1]["params"]
                    res[key]["params_rel_diff"] = float((a - b).norm() / b.norm())
            out["models"][name] = res
        out["switch"] = st.vswitch().counters()["switch"]
        return out
    finally:
        _stop(flows)
        rack.down(st)
        shutil.rmtree(tmp, ignore_errors=True)


def _targets(by_rate: dict) -> dict:
    """The issue's goals, for the models of 1 M parameters and more, at every rate measured:
    hook ÷ gloo ≤ 1 without congestion, ≤ 0.5 with; at 1 Gbit/s the hook within 2× its
    wire-time bound."""
    big = [(r, m) for r, at in by_rate.items() for m in at["models"].values() if m["parameters"] >= 1e6]
    gbit = [m for r, m in big if by_rate[r]["rate_bps"] == 1_000_000_000]
    return {
        "hook_le_allreduce_from_1M": all(m["no_congestion"]["hook_over_allreduce"] <= 1.0 for _, m in big),
        "hook_le_half_allreduce_congested_from_1M": all(m["with_congestion"]["hook_over_allreduce"] <= 0.5
                                                        for _, m in big),
        "hook_within_2x_wire_bound_at_1gbit": (all(m["no_congestion"]["hook_over_wire_bound"] <= 2.0 for m in gbit)
                                               if gbit else None),
    }
