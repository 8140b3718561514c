"""SONiC: a Config DB fragment (SWITCH_TRIMMING, BUFFER_PROFILE/QUEUE, QoS maps, the
DISABLE_TRIM ACL) and the `config` CLI lines that apply the same."""

from __future__ import annotations

import ipaddress
import json

from trimlab.targets.base import Port, Rendered, SwitchTarget


class Sonic(SwitchTarget):
    name = "sonic"
    port_pattern = r"Ethernet\d+"
    default_ports = (Port("Ethernet0"), Port("Ethernet4"), Port("Ethernet8", "network"))

    def check(self, profile, ports):
        super().check(profile, ports)
        if not 1 <= profile.size <= 9216:
            raise self.fail("size", profile.size, "1..9216 bytes")
        if isinstance(profile.queue, int) and not 0 <= profile.queue <= 255:
            raise self.fail("queue", profile.queue, "a queue index 0..255 (uint8) or dynamic")

    def context(self, profile, ports: list[Port]) -> dict:
        exempt = [{"name": f"EXEMPT_{i}", "priority": 9999 - i,
                   "field": "SRC_IPV6" if ipaddress.ip_network(src).version == 6 else "SRC_IP",
                   "prefix": src} for i, src in enumerate(profile.exempt_sources)]
        queues = []
        for port in ports:
            queues += [(f"{port.name}|{tc}", "trimlab_trim_profile") for tc in sorted(set(profile.eligible_queues))]
            if profile.queue != "dynamic":
                queues.append((f"{port.name}|{profile.queue}", "trimlab_trimmed_profile"))
        return {"p": profile, "ports": ports, "exempt": exempt, "buffer_queues": queues,
                "dscp_map": {d: profile.tc_of(d) for d in range(64)} if profile.dscp_to_tc is not None else None}

    def _render(self, profile, ports):
        ctx = self.context(profile, ports)
        config = json.loads(self._template("config_db.json.j2", **ctx))
        commands = self._template("commands.sh.j2", **ctx).strip().splitlines()
        return Rendered(self.name, profile.name, config, "json", commands)
