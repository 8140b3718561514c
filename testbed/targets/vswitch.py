"""trimlab's eBPF virtual switch: the SONiC Config DB fragment it reads (the same tables
as the SONiC target, so a profile means the same on both) plus TRIMLAB_INJECT."""

from __future__ import annotations

import json

from trimlab.testbed.targets.base import Port, Rendered, SwitchTarget
from trimlab.testbed.targets.sonic import Sonic

MIN_TRIM_SIZE = 14 + 40 + 8  # Ethernet + IPv6 + UDP: every trimmed packet keeps its L4 header
NQ = 8  # queues a port


class VSwitchTarget(Sonic):
    name = "vswitch"
    supports_injection = True
    default_ports = (Port("Ethernet0"), Port("Ethernet4"), Port("Ethernet8"))
    mtu = 9000

    def configure(self, name: str, host_vars: dict) -> None:
        """The data network's MTU bounds the trim size (no VOQ here)."""
        SwitchTarget.configure(self, name, host_vars)
        self.mtu = int(host_vars.get("data_mtu", self.mtu))

    def check(self, profile, ports):
        SwitchTarget.check(self, profile, ports)  # not Sonic.check: other limits here
        if not MIN_TRIM_SIZE <= profile.size <= self.mtu + 14:
            raise self.fail("size", profile.size, f"{MIN_TRIM_SIZE}..{self.mtu + 14} bytes (MTU {self.mtu})")
        if profile.queue == "dynamic" or not 0 <= profile.queue <= 7:
            raise self.fail("queue", profile.queue, "a queue 0..7 (no dynamic)")
        if profile.exempt_sources:
            raise self.fail("exempt_sources", profile.exempt_sources, "none (no ACL stage)")

    def _render(self, profile, ports):
        config = json.loads(self._template("sonic/config_db.json.j2", **self.context(profile, ports)))
        config.update(json.loads(self._template("inject.json.j2", p=profile)))
        # The rack is ours: its other queues take the profile's data-queue budget too, so a
        # run's buffer deepens every class (gloo's TCP, the hook's parameters), not only the
        # trimming ones. A SONiC switch's other queues keep their own buffer configuration.
        bound = set(profile.eligible_queues) | {profile.queue}
        ranges = []  # SONiC's BUFFER_QUEUE keys name one queue or a range: PORT|2-5
        for q in range(NQ):
            if q in bound:
                continue
            if ranges and ranges[-1][1] == q - 1:
                ranges[-1][1] = q
            else:
                ranges.append([q, q])
        if ranges:
            config["BUFFER_PROFILE"]["trimlab_queue_profile"] = {
                "pool": "egress_lossy_pool", "size": "0", "static_th": str(profile.buffer.queue_bytes),
                "packet_discard_action": "drop"}
            keys = [f"{p.name}|{a}" + (f"-{b}" if b > a else "") for p in ports for a, b in ranges]
            config["BUFFER_QUEUE"].update({k: {"profile": "trimlab_queue_profile"} for k in keys})
        config["TRIMLAB_PLATFORM"] = {"GLOBAL": {"name": self.platform.name}}
        commands = [f"trimlab switch apply trimlab-{profile.name}.json"]
        return Rendered(self.name, profile.name, config, "json", commands)
