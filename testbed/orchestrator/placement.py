"""Which host runs what, the run's switch profile and the agents' configuration: everything
checked before the rack is touched."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from trimlab.testbed import inventory as inv
from trimlab import resources, wire
from trimlab.testbed import remote
from trimlab.codec import get_codec
from trimlab.config import (
    AgentConfig,
    CodecConfig,
    HostConfig,
    TransportConfig,
    parse_rate,
)
from trimlab.errors import SpecError, TrimlabError
from trimlab.testbed.provision import render_profiles
from trimlab.spec import ExperimentSpec, load_profile
from trimlab import platforms
from trimlab.testbed.targets import get_target



class RunFailed(TrimlabError):
    """The run started but did not complete: the manifest says why."""

    exit_code = 1


def ddp_script(spec: ExperimentSpec) -> str:
    return spec.workload.script or str(resources.example_ddp_script())


@dataclass
class Placement:
    rack: inv.Rack
    switches: list[inv.SwitchEntry]
    workers: list[inv.HostEntry]
    ps: inv.HostEntry | None
    traffic: list[inv.HostEntry]
    hosts: dict[str, remote.Host] = field(default_factory=dict)

    def addr(self, h: inv.HostEntry, ipv6: bool) -> str:
        return h.vars["data_ipv6" if ipv6 else "data_ipv4"]

    @property
    def sink(self) -> inv.HostEntry:
        """Where background flows go: the ps's port (the incast's), else the first worker's."""
        return self.ps or self.workers[0]

    def entries(self) -> list[inv.HostEntry | inv.SwitchEntry]:
        return [*self.switches, *self.workers, *self.traffic, *([self.ps] if self.ps else [])]

    @property
    def virtual_switches(self) -> list[inv.SwitchEntry]:
        """The switches whose counters and queues a run reads (trimlab's virtual switch)."""
        return [s for s in self.switches if s.os == "vswitch"]

    def platform(self, sw: inv.SwitchEntry) -> platforms.Platform:
        return platforms.for_switch(sw.name, sw.os, self.rack.vars | sw.vars)

    def platforms(self) -> dict[str, dict]:
        """Switch label -> {name, stale, needs_repair}: what the analysis needs of each."""
        return {self.label(sw): {"name": (pl := self.platform(sw)).name, "stale": pl.stale,
                                 "needs_repair": pl.needs_repair} for sw in self.switches}

    def label(self, sw: inv.SwitchEntry) -> str:
        """A switch's name in the run directory: the rack's own name for it (leaf1, spine1)
        where the inventory gives one, else its inventory name."""
        return str(sw.vars.get("trimlab_switch") or sw.name)

    def entry(self, name: str) -> inv.HostEntry | inv.SwitchEntry:
        return next(e for e in self.entries() if e.name == name)

    def python(self, name: str) -> str:
        return (self.rack.vars | self.entry(name).vars).get("trimlab_python", "/opt/trimlab/venv/bin/python")

    def cli(self, name: str) -> str:
        return (self.rack.vars | self.entry(name).vars).get("trimlab_cli", "/opt/trimlab/venv/bin/trimlab")

    def links(self) -> list[tuple[str, str]]:
        """Switch-to-switch links as (label:port, label:port), each once, from the inventory's
        network-facing ports that name their peer (`peer: SWITCH:PORT`)."""
        by_name = {sw.name: sw for sw in self.switches}
        out = set()
        for sw in self.switches:
            for port, d in sw.ports.items():
                peer_sw, _, peer_port = str(d.get("peer") or "").rpartition(":")
                if peer_sw in by_name:
                    a, b = f"{self.label(sw)}:{port}", f"{self.label(by_name[peer_sw])}:{peer_port}"
                    out.add((min(a, b), max(a, b)))
        return sorted(out)

    def switch_of(self, name: str) -> tuple[inv.SwitchEntry, str | None]:
        """The switch and port a host is cabled to (the inventory's ports, else its switch_port)."""
        for sw in self.switches:
            for port, d in sw.ports.items():
                if d.get("host") == name:
                    return sw, port
        return self.switches[0], self.entry(name).vars.get("switch_port")


def place(rack: inv.Rack, spec: ExperimentSpec) -> Placement:
    """Assign roles and check that the rack can run `spec` (before anything is touched)."""
    by_role = {r: [h for h in rack.hosts if h.role == r] for r in inv.ROLES}
    if not by_role["worker"]:
        raise SpecError(f"inventory {rack.path}: no host with role worker")
    if spec.topology == "ps" and not by_role["ps"]:
        raise SpecError(f"topology=ps: inventory {rack.path} has no host with role ps")
    if spec.topology == "sharded" and len(by_role["worker"]) < 2:
        raise SpecError(f"topology=sharded: inventory {rack.path} needs at least 2 workers")
    if spec.congestion.background and not by_role["traffic"]:
        raise SpecError("congestion.background: the rack has no traffic host; set "
                        "rack.virtual.traffic_hosts: 1 (or add a host with role traffic)")
    family = "data_ipv6" if spec.transport.ipv6 else "data_ipv4"
    for h in rack.hosts:
        if not h.vars.get(family):
            raise SpecError(f"host {h.name}: {family} is missing (transport.ipv6={spec.transport.ipv6})")
    real = [s.name for s in rack.switches if s.os != "vswitch"]
    if "switch" in spec.capture.points and real:
        raise SpecError(f"capture.points: 'switch' needs the virtual switch; {real[0]} is {rack.switches[0].os} "
                        "(a real switch's ports are captured with a tap or mirror port)")
    p = Placement(rack, rack.switches, by_role["worker"],
                  by_role["ps"][0] if spec.topology == "ps" else None, by_role["traffic"])
    for e in p.entries():
        p.hosts[e.name] = remote.Host.from_inventory(e.name, e.vars, rack.vars)
    return p


def effective_profile(spec: ExperimentSpec):
    """The named profile with the run's buffer (virtual rack) and injection applied."""
    prof = load_profile(spec.profile)
    data = prof.model_dump(mode="json")
    if spec.rack.virtual is not None:
        data["buffer"]["queue_bytes"] = spec.rack.virtual.buffer_bytes
    c = spec.congestion
    data["injection"] = {"probability": c.inject_probability, "action": c.inject_action, "seed": spec.seed}
    if spec.workload.kind == "ddp" and spec.workload.comm == "gloo":  # gloo's TCP: DSCP 0, a queue that drops
        data["injection"]["queues"] = [prof.tc_of(0)]
    return type(prof).model_validate(data)


def check_profile(spec: ExperimentSpec, rack: inv.Rack | None) -> None:
    """Every target's limits, before the rack is touched."""
    prof = effective_profile(spec)
    if rack is None:
        t = get_target("vswitch")
        for name in sorted(spec.rack.virtual.platform_names()):
            t.configure("sw", {"trim_switch_platform": name})
            try:
                t.check(prof, list(t.default_ports))
            except SpecError as exc:
                raise SpecError(f"profile {prof.name}: {exc} (rack.virtual.platform)") from None
        return
    tmp = Path(tempfile.mkdtemp(prefix="trimlab-run-"))
    try:
        path = tmp / f"{prof.name}.yml"
        path.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False))
        render_profiles(rack, str(path), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def packet_coords(spec: ExperimentSpec, mtu: int) -> int:
    """Coordinates per packet: the spec's, checked against the MTU, or as many as fit."""
    codec = get_codec(spec.codec.name, **spec.codec.params)
    best = wire.max_coords(codec, mtu, spec.transport.ipv6)
    if spec.codec.coords and spec.codec.coords > best:
        raise SpecError(f"codec.coords={spec.codec.coords}: does not fit mtu={mtu} with codec "
                        f"{codec.name}; at most {best}")
    return spec.codec.coords or wire.fill_coords(codec, mtu, spec.codec.span, spec.transport.ipv6)


def agent_config(spec: ExperimentSpec, p: Placement, mtu: int, rate_bps: int) -> AgentConfig:
    t = spec.transport
    codec = get_codec(spec.codec.name, **spec.codec.params)
    coords = packet_coords(spec, mtu)
    pacing = parse_rate(t.pacing) if t.pacing else None
    if pacing is None and not spec.congestion.incast and spec.topology == "ps":
        pacing = int(0.9 * rate_bps / len(p.workers))  # together, the workers fit the ps's port
    return AgentConfig(
        name=spec.name, job=spec.job, seed=spec.seed, steps=spec.workload.steps, mtu=mtu, topology=spec.topology,
        workload=spec.workload,
        codec=CodecConfig(name=codec.name, params=codec.params(), span=spec.codec.span, coords=coords),
        transport=TransportConfig(dscp=t.dscp, control_dscp=t.control_dscp, deadline_ms=t.deadline_ms,
                                  pacing_bps=pacing, kernel_shaping=p.rack.virtual, port=t.port, ipv6=t.ipv6),
        truth_every=spec.truth.every, eval_every=spec.workload.eval_every,
        ps=HostConfig(name=p.ps.name, addr=p.addr(p.ps, t.ipv6)) if p.ps else None,
        workers=[HostConfig(name=w.name, addr=p.addr(w, t.ipv6)) for w in p.workers])
