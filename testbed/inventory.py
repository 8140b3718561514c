"""Ansible YAML inventory <-> Rack model: the switches (trim_switches) and the NIC hosts
(nic_hosts) with their merged variables, validated before anything touches the rack."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from trimlab.errors import SpecError
from trimlab.spec import read_yaml
from trimlab.testbed.targets import TARGETS

ROLES = ("worker", "ps", "traffic")


@dataclass
class SwitchEntry:
    name: str
    os: str
    ports: dict[str, dict]  # port name -> {host, facing, speed_mbps}
    vars: dict = field(default_factory=dict)


@dataclass
class HostEntry:
    name: str
    role: str
    data_if: str
    vars: dict = field(default_factory=dict)


@dataclass
class Rack:
    path: Path
    switches: list[SwitchEntry]
    hosts: list[HostEntry]
    vars: dict

    @property
    def virtual(self) -> bool:
        return bool(self.vars.get("trimlab_virtual"))


def _walk(group: dict, name: str, inherited: dict, out: dict[str, dict[str, dict]]) -> None:
    """Collect each host's variables per top-level group (all.vars < group vars < host vars)."""
    gvars = {**inherited, **(group.get("vars") or {})}
    for host, hvars in (group.get("hosts") or {}).items():
        out.setdefault(name, {})[host] = {**gvars, **(hvars or {})}
    for child, body in (group.get("children") or {}).items():
        _walk(body or {}, child if name == "all" else name, gvars, out)


def load(path: str | Path) -> Rack:
    path = Path(path)
    doc = read_yaml(path, "inventory")
    if not isinstance(doc, dict) or "all" not in doc:
        raise SpecError(f"inventory {path}: expected a YAML inventory with a top-level 'all' group")
    groups: dict[str, dict[str, dict]] = {}
    _walk(doc["all"] or {}, "all", {}, groups)
    for g in ("trim_switches", "nic_hosts"):
        if not groups.get(g):
            raise SpecError(f"inventory {path}: group {g} is missing or empty")
    switches = []
    for name, v in groups["trim_switches"].items():
        os_ = v.get("trim_switch_os")
        if os_ not in TARGETS:
            raise SpecError(f"switch {name}: trim_switch_os={os_!r}; use one of {', '.join(TARGETS)}")
        ports = v.get("ports")
        if not isinstance(ports, dict) or not ports:
            raise SpecError(f"switch {name}: ports is missing; map each port to its host, e.g. "
                            f"ports: {{Ethernet0: {{host: gpu1, facing: host}}}}")
        switches.append(SwitchEntry(name, os_, {p: dict(d or {}) for p, d in ports.items()}, v))
    hosts = []
    for name, v in groups["nic_hosts"].items():
        if v.get("role") not in ROLES:
            raise SpecError(f"host {name}: role={v.get('role')!r}; use one of {', '.join(ROLES)}")
        if not v.get("data_if"):
            raise SpecError(f"host {name}: data_if is missing; name its data-network interface")
        if not (v.get("data_ipv4") or v.get("data_ipv6")):
            raise SpecError(f"host {name}: give data_ipv4 and/or data_ipv6 (its data-network address)")
        if not v.get("ansible_host"):
            raise SpecError(f"host {name}: ansible_host is missing (its management address)")
        hosts.append(HostEntry(name, v["role"], v["data_if"], v))
    known = {h.name for h in hosts}
    for sw in switches:
        for port, d in sw.ports.items():
            if d.get("host") and d["host"] not in known:
                raise SpecError(f"switch {sw.name}: port {port} is cabled to {d['host']!r}, "
                                f"which is not in nic_hosts")
    return Rack(path, switches, hosts, (doc["all"] or {}).get("vars") or {})
