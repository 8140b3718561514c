"""The agents' command lines (and the DDP scripts' environment), one function each: the
only place that knows how an agent is started on a host."""

from __future__ import annotations

from trimlab import wire
from trimlab.config import RENDEZVOUS_PORT, STREAM_PORT_OFFSET, TRAFFIC_PORT
from trimlab.testbed.orchestrator.placement import Placement, ddp_script
from trimlab.testbed.inventory import SwitchEntry
from trimlab.spec import BackgroundFlow, ExperimentSpec


def _agent(p: Placement, host: str, module: str, *args: str) -> list[str]:
    return [p.python(host), "-m", f"trimlab.agents.{module}", *args]


def capture_filter(spec: ExperimentSpec, flows_to_host: int = 0) -> str:
    """Gradient and control ports; the sharded all-gather's TCP streams, or with DDP over
    gloo its TCP, the only TCP on the data network; at the background flows' sink their
    ports too (so the switch's trim count can be matched there)."""
    port = spec.transport.port
    f = f"udp and (port {port} or port {port + 1})"
    if spec.workload.kind == "ddp" and spec.workload.comm == "gloo":
        f = f"tcp or ({f})"
    elif spec.topology == "sharded":
        f = f"({f}) or (tcp and port {port + STREAM_PORT_OFFSET})"
    return f"{f} or portrange {TRAFFIC_PORT}-{TRAFFIC_PORT + flows_to_host - 1}" if flows_to_host else f


def capture(p: Placement, host: str, ifaces: list[str], snaplen: int, out: str, bpf: str) -> list[str]:
    argv = _agent(p, host, "capture", "--snaplen", str(snaplen), "--out", out, "--name", host, "--filter", bpf)
    for iface in ifaces:
        argv += ["--iface", iface]
    return argv


def _switch_args(sw: SwitchEntry, rack_args: list[str]) -> list[str]:
    """Which rack, and which of its switches (a fabric's inventory names each)."""
    name = sw.vars.get("trimlab_switch")
    return [*rack_args, *(["--switch", str(name)] if name else [])]


def sampler(p: Placement, sw: SwitchEntry, out: str, rack_args: list[str]) -> list[str]:
    return [p.cli(sw.name), "switch", "sample", "--out", out, *_switch_args(sw, rack_args)]


def counters(p: Placement, sw: SwitchEntry, rack_args: list[str]) -> list[str]:
    return [p.cli(sw.name), "switch", "counters", "--json", *_switch_args(sw, rack_args)]


def repair_status(p: Placement, host: str, data_if: str) -> list[str]:
    return _agent(p, host, "repair", "status", "--dev", data_if)


def sink(p: Placement, i: int, flow: BackgroundFlow, dst: str) -> list[str]:
    return _agent(p, p.sink.name, "traffic", "sink", "--bind", dst, "--port", str(TRAFFIC_PORT + i),
                  "--protocol", flow.protocol)


def traffic(p: Placement, host: str, i: int, flow: BackgroundFlow, dscp: int, dst: str, mtu: int) -> list[str]:
    """One background flow. Its datagrams fill the MTU: the kernel's cost is per packet, so a
    jumbo-frame rack carries six times the load for the same CPU. On a virtual rack the
    host NIC is ours (an htb class of its own shapes the flow) and the sender runs at the
    highest priority: it stands in for a lab's dedicated traffic host, and the trainers
    sharing its cores must not take its rate."""
    size = mtu - wire.ip_udp_overhead(":" in dst)
    return _agent(p, host, "traffic", "send", "--dst", dst, "--port", str(TRAFFIC_PORT + i), "--rate", flow.rate,
                  "--dscp", str(dscp), "--protocol", flow.protocol, "--pattern", flow.pattern,
                  "--on-ms", str(flow.on_ms), "--off-ms", str(flow.off_ms), "--size", str(size),
                  *(["--kernel-shaping", "--nice", "-20"] if p.rack.virtual else []))


def worker(p: Placement, host: str, rank: int, config: str, out: str) -> list[str]:
    return _agent(p, host, "worker", "--config", config, "--rank", str(rank), "--out", out)


def ps(p: Placement, config: str, out: str) -> list[str]:
    return _agent(p, p.ps.name, "ps", "--config", config, "--out", out)


def ddp(p: Placement, spec: ExperimentSpec, rank: int, config: str, out: str) -> tuple[list[str], dict]:
    """The DDP script on worker `rank` with torchrun's environment. With comm trimlab, gloo
    meets on the management network at rank 0 and gradients go through the switch via the
    comm hook; with comm gloo, gloo itself (rendezvous and all-reduce, TCP, DSCP 0) runs on
    the data network, through the same switch: the stock reliable path."""
    wl, w = spec.workload, p.workers[rank]
    gloo = wl.comm == "gloo"
    first = p.workers[0]
    master = p.addr(first, spec.transport.ipv6) if gloo else p.hosts[first.name].address
    env = {"MASTER_ADDR": master, "MASTER_PORT": str(RENDEZVOUS_PORT),
           "RANK": str(rank), "WORLD_SIZE": str(len(p.workers)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
           "TRIMLAB_CONFIG": config, "TRIMLAB_OUT": out}
    if gloo:
        env["GLOO_SOCKET_IFNAME"] = (p.rack.vars | w.vars).get("data_if", "eth1")
    elif p.rack.virtual:
        env["GLOO_SOCKET_IFNAME"] = "eth0"  # the management network
    if p.rack.virtual:  # every virtual host shares this machine's cores
        env["OMP_NUM_THREADS"] = "1"
    argv = [p.python(w.name), ddp_script(spec), "--steps", str(wl.steps), "--batch", str(wl.batch),
            "--lr", str(wl.lr), "--seed", str(spec.seed), "--comm", "allreduce" if gloo else "trimlab",
            "--data", wl.data, "--model", wl.model, "--eval-every", str(wl.eval_every)]
    if wl.width:
        argv += ["--width", str(wl.width)]
    if wl.time_limit_s:
        argv += ["--time-limit", str(wl.time_limit_s)]
    return argv, env
