"""The run's data network as a graph, from its manifest: which switch port each host is
cabled to, and the links between switches. Ports are named `switch:port` when the run
drove several switches (a fabric), else by their own name.

The analysis asks it where a packet from one host to another may have left a switch:
every egress port on every shortest path (equal-cost multipath may take any of them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from trimlab import rundir


def qualified(switch: str | None, port: str | None) -> str | None:
    return f"{switch}:{port}" if switch and port else port


@dataclass
class Topology:
    host_port: dict[str, str]  # host -> the (qualified) switch port it hangs off
    host_switch: dict[str, str | None]
    links: list[tuple[str, str]] = field(default_factory=list)  # (qualified port, qualified port)

    @classmethod
    def from_manifest(cls, manifest: rundir.Manifest) -> "Topology":
        several = len(manifest.switches) > 1
        ports, switches = {}, {}
        for name, f in manifest.hosts.items():
            if f.get("role") in (None, "switch") or not f.get("switch_port"):
                continue
            sw = f.get("switch") if several else None
            ports[name], switches[name] = qualified(sw, f["switch_port"]), sw
        return cls(ports, switches, [tuple(link) for link in manifest.links])

    @property
    def fabric(self) -> bool:
        """Several switches: ports are named switch:port."""
        return any(sw is not None for sw in self.host_switch.values())

    def _neighbours(self) -> dict[str, list[tuple[str, str]]]:
        """switch -> [(its egress port, the switch at the other end)]."""
        out: dict[str, list[tuple[str, str]]] = {}
        for a, b in self.links:
            sa, sb = a.split(":", 1)[0], b.split(":", 1)[0]
            out.setdefault(sa, []).append((a, sb))
            out.setdefault(sb, []).append((b, sa))
        return out

    def egress_ports(self, src: str, dst: str) -> list[str]:
        """Every switch port a packet from `src` to `dst` may leave by, in path order."""
        if dst not in self.host_port:
            return []
        a, b = self.host_switch.get(src), self.host_switch.get(dst)
        if a is None or b is None or a == b:
            return [self.host_port[dst]]
        nbrs = self._neighbours()
        dist = {b: 0}  # hops to the destination's switch
        todo = deque([b])
        while todo:
            s = todo.popleft()
            for _, t in nbrs.get(s, []):
                if t not in dist:
                    dist[t] = dist[s] + 1
                    todo.append(t)
        if a not in dist:
            return []
        out, frontier = [], [a]
        while frontier:  # walk every shortest path from the sender's switch, a hop at a time
            nxt = []
            for s in frontier:
                for port, t in nbrs.get(s, []):
                    if dist.get(t) == dist[s] - 1:
                        out.append(port)
                        if t not in nxt:
                            nxt.append(t)
            frontier = [t for t in nxt if t != b]
        return out + [self.host_port[dst]]
