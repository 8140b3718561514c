"""Cumulus Linux (NVIDIA Spectrum-4/5): `nv set ... packet-trim` commands and the same
configuration as data for the nvidia.nvue.api module."""

from __future__ import annotations

import yaml

from trimlab.testbed.targets.base import Port, Rendered, SwitchTarget


class Cumulus(SwitchTarget):
    name = "cumulus"
    port_pattern = r"swp\d+(s\d+)?"
    default_ports = (Port("swp1"), Port("swp2"), Port("swp3", "network"))

    def check(self, profile, ports):
        super().check(profile, ports)
        if profile.queue == "dynamic" or not 0 <= profile.queue <= 7:
            raise self.fail("queue", profile.queue, "a switch priority 0..7 (no dynamic)")
        for tc in profile.eligible_queues:
            if not 0 <= tc <= 7:
                raise self.fail("eligible_queues", tc, "traffic classes 0..7")
        if profile.exempt_sources:
            raise self.fail("exempt_sources", profile.exempt_sources,
                            "none: Cumulus has no DISABLE_TRIM ACL action")
        if profile.discard_action != "trim":
            raise self.fail("discard_action", profile.discard_action,
                            "trim only (to drop, leave packet trimming disabled)")
        if profile.dscp_to_tc is not None:
            raise self.fail("dscp_to_tc", "...", "none: set Cumulus QoS mappings with nv set qos mapping")

    def _render(self, profile, ports):
        groups = {}
        for p in ports:
            groups.setdefault(p.facing, []).append(p.name)
        ctx = {"p": profile, "ports": ports, "port_list": ",".join(p.name for p in ports),
               "groups": groups}
        commands = self._template("nvue.sh.j2", **ctx).strip().splitlines()
        config = yaml.safe_load(self._template("nvue_api.yml.j2", **ctx))
        return Rendered(self.name, profile.name, config, "yaml", commands)
