"""SONiC: a Config DB fragment (SWITCH_TRIMMING, BUFFER_PROFILE/QUEUE, QoS maps, the
DISABLE_TRIM ACL) and the `config` CLI lines that apply the same. Packet trimming exists
from SONiC 202505 on, on switches whose ASIC reports it (STATE_DB SWITCH_CAPABILITY|switch
SWITCH_TRIMMING_CAPABLE); the role's task file checks both before it writes anything."""

from __future__ import annotations

import ipaddress
import json

from trimlab.errors import SpecError
from trimlab.testbed.targets.base import Port, Rendered, SwitchTarget


class Sonic(SwitchTarget):
    name = "sonic"
    port_pattern = r"Ethernet\d+"
    default_ports = (Port("Ethernet0"), Port("Ethernet4"), Port("Ethernet8", "network"))
    RELEASE_FLOOR = "202505"  # the first release with SWITCH_TRIMMING and `config switch-trimming`

    def __init__(self):
        super().__init__()
        self.voq_prefix = ""  # "hostname|asic|" on a VOQ switch: its BUFFER_QUEUE keys

    def configure(self, name: str, host_vars: dict) -> None:
        """A VOQ (distributed) switch keys BUFFER_QUEUE as hostname|asic|port|queue: take the
        hostname and ASIC name from the inventory, or refuse by name."""
        super().configure(name, host_vars)
        kind = host_vars.get("switch_type", "switch")
        if kind not in ("switch", "voq"):
            raise SpecError(f"switch {name}: switch_type={kind!r}; trimlab renders SONiC switch_type "
                            "switch or voq")
        if kind == "voq":
            asic = host_vars.get("asic_name")
            if not asic:
                raise SpecError(f"switch {name}: switch_type voq keys BUFFER_QUEUE as hostname|asic|port|queue; "
                                "set asic_name (e.g. asic0) and, if it differs from the inventory name, "
                                "sonic_hostname for this switch in the inventory")
            self.voq_prefix = f"{host_vars.get('sonic_hostname', name)}|{asic}|"

    def check(self, profile, ports):
        super().check(profile, ports)
        if isinstance(profile.queue, int) and not 0 <= profile.queue <= 15:
            raise self.fail("queue", profile.queue, "a queue index 0..15 (sonic-buffer-queue.yang's qindex) "
                            "or dynamic")

    def context(self, profile, ports: list[Port]) -> dict:
        exempt = [{"name": f"EXEMPT_{i}", "priority": 9999 - i,
                   "field": "SRC_IPV6" if ipaddress.ip_network(src).version == 6 else "SRC_IP",
                   "prefix": src} for i, src in enumerate(profile.exempt_sources)]
        queues = []
        for port in ports:
            key = f"{self.voq_prefix}{port.name}"
            queues += [(f"{key}|{tc}", "trimlab_trim_profile") for tc in sorted(set(profile.eligible_queues))]
            if profile.queue != "dynamic":
                queues.append((f"{key}|{profile.queue}", "trimlab_trimmed_profile"))
        return {"p": profile, "ports": ports, "exempt": exempt, "buffer_queues": queues,
                "dscp_map": {d: profile.tc_of(d) for d in range(64)} if profile.dscp_to_tc is not None else None}

    def _render(self, profile, ports):
        ctx = self.context(profile, ports)
        config = json.loads(self._template("config_db.json.j2", **ctx))
        commands = self._template("commands.sh.j2", **ctx).strip().splitlines()
        return Rendered(self.name, profile.name, config, "json", commands)
