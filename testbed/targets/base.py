"""The switch-target driver interface and what its drivers share."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import ClassVar

import jinja2
import yaml

from trimlab import resources
from trimlab.errors import SpecError
from trimlab import platforms

TEMPLATES = resources.templates()


@dataclass(frozen=True)
class Port:
    name: str
    facing: str = "host"  # host | network: picks the DSCP of an asymmetric profile


@dataclass
class Rendered:
    """What a target would apply: structured config, the CLI lines that do the same."""

    target: str
    profile: str
    config: dict
    config_format: str  # json | yaml
    commands: list[str] = field(default_factory=list)

    def config_text(self) -> str:
        if self.config_format == "json":
            return json.dumps(self.config, indent=2, sort_keys=True) + "\n"
        return yaml.safe_dump(self.config, sort_keys=True)

    def text(self) -> str:
        return (f"# {self.target}: profile {self.profile}\n# --- config ({self.config_format})\n"
                + self.config_text() + "# --- commands\n" + "\n".join(self.commands) + "\n")


class SwitchTarget:
    name: ClassVar[str]
    port_pattern: ClassVar[str]
    default_ports: ClassVar[tuple[Port, ...]]
    supports_injection: ClassVar[bool] = False  # deterministic injection: the virtual switch only

    def __init__(self):
        self.platform = platforms.get(platforms.DEFAULT_FOR_OS[self.name])

    def _env(self) -> jinja2.Environment:
        return jinja2.Environment(loader=jinja2.FileSystemLoader([TEMPLATES / self.name, TEMPLATES]),
                                  undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                                  trim_blocks=True, lstrip_blocks=True)

    def _template(self, name: str, **ctx) -> str:
        """Render switch_configs/<target>/NAME (or switch_configs/NAME for a shared one)."""
        return self._env().get_template(name).render(**ctx)

    def configure(self, name: str, host_vars: dict) -> None:
        """Take what rendering needs from the switch's inventory variables: its platform
        (trim_switch_platform), and in a driver whatever else it renders."""
        self.platform = platforms.for_switch(name, self.name, host_vars)

    def fail(self, field_: str, value, allowed: str) -> SpecError:
        return SpecError(f"field {field_}={value!r}: target {self.name} allows {allowed}")

    def check(self, profile, ports: list[Port]) -> None:
        """Raise SpecError (profile field, target, allowed range) if the OS cannot do it."""
        if not ports:
            raise SpecError(f"target {self.name}: the switch has no ports in the inventory")
        for p in ports:
            if not re.fullmatch(self.port_pattern, p.name):
                raise SpecError(f"port {p.name!r}: target {self.name} names ports like "
                                f"{self.default_ports[0].name}")
            if p.facing not in ("host", "network"):
                raise SpecError(f"port {p.name}: facing={p.facing!r}; use host or network")
        if profile.injection.probability and not self.supports_injection:
            raise self.fail("injection.probability", profile.injection.probability,
                            "0 only: deterministic injection is a virtual-switch feature")
        self.platform.check(profile)
        if profile.dscp == "from-tc":
            missing = {p.facing for p in ports} - set(profile.port_dscp)
            if missing:
                raise SpecError(f"profile field port_dscp: no DSCP for {'/'.join(sorted(missing))}-facing "
                                f"ports of this switch")

    def render(self, profile, ports: list[Port]) -> Rendered:
        """Check the target's limits, then render; an error names profile, field and target."""
        try:
            self.check(profile, ports)
        except SpecError as exc:
            raise SpecError(f"profile {profile.name}: {exc}") from None
        return self._render(profile, ports)

    def _render(self, profile, ports: list[Port]) -> Rendered:
        raise NotImplementedError

