"""Switch platforms: what each switch model does to a packet it trims, from the catalog
switch_configs/platforms.yml. A profile is checked against its switch's platform before
anything is rendered; the virtual switch emulates the platform it stands for."""

from __future__ import annotations

import functools
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field

from trimlab import resources
from trimlab.errors import SpecError

VIRTUAL_DEFAULT = "sonic"  # the virtual rack rehearses what a lab sees: stale headers
DEFAULT_FOR_OS = {"sonic": "sonic", "cumulus": "cumulus-spectrum", "vswitch": VIRTUAL_DEFAULT}
HEADER_FIELDS = ("ip_length", "ipv4_checksum", "udp_length", "l4_checksum")
# trim.c's gcfg.flags: which fields the switch rewrites after a cut, and trim-once
FLAG_BITS = {"ip_length": 1, "ipv4_checksum": 2, "udp_length": 4, "l4_checksum": 8}
FLAG_TRIM_ONCE = 16

Rule = Literal["stale", "rewritten"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Headers(_Strict):
    ip_length: Rule
    ipv4_checksum: Rule
    udp_length: Rule
    l4_checksum: Rule


class SizeRule(_Strict):
    fixed: int | None = None
    min: int = 1
    max: int = 9216
    multiple: int = Field(1, ge=1)

    def allows(self, size: int) -> bool:
        if self.fixed is not None:
            return size == self.fixed
        return self.min <= size <= self.max and size % self.multiple == 0

    def text(self) -> str:
        if self.fixed is not None:
            return f"{self.fixed} bytes only"
        step = f", a multiple of {self.multiple}" if self.multiple > 1 else ""
        return f"{self.min}..{self.max} bytes{step}"


class Counters(_Strict):
    trim_drop: Literal["counted", "derived"]
    clear_when_disabled: bool
    per_class: bool


class Platform(_Strict):
    name: str
    description: str
    source: str
    targets: list[str]
    headers: Headers
    trim_size: SizeRule
    trim_queues: list[int]
    default_trim_queue: int
    marking: Literal["dscp", "uec"]
    trims_twice: bool
    counters: Counters

    @property
    def stale(self) -> list[str]:
        """The header fields a trimmed packet arrives with unchanged from before the cut."""
        return [f for f in HEADER_FIELDS if getattr(self.headers, f) == "stale"]

    @property
    def needs_repair(self) -> bool:
        """A Linux host drops this platform's trimmed packets unless trimlab repairs them."""
        return bool(self.stale)

    @property
    def flags(self) -> int:
        out = sum(bit for f, bit in FLAG_BITS.items() if getattr(self.headers, f) == "rewritten")
        return out | (0 if self.trims_twice else FLAG_TRIM_ONCE)

    def fail(self, field_: str, value, allowed: str) -> SpecError:
        return SpecError(f"field {field_}={value!r}: platform {self.name} allows {allowed}")

    def check(self, profile) -> None:
        """Raise SpecError (field, value, this platform's limit) for what it cannot do."""
        if not self.trim_size.allows(profile.size):
            raise self.fail("size", profile.size, self.trim_size.text())
        if profile.queue != "dynamic" and profile.queue not in self.trim_queues:
            raise self.fail("queue", profile.queue, f"trimmed packets on queues {_ranges(self.trim_queues)}")
        if self.marking == "uec" and (profile.dscp != "from-tc" or set(profile.port_dscp) != {"host", "network"}):
            raise self.fail("dscp", profile.dscp, "two code points: dscp: from-tc with port_dscp network "
                            "(trimmed) and host (trimmed, last hop)")

    def summary(self) -> str:
        """One line: what this platform does to a trimmed packet and what trimlab does about it."""
        if not self.needs_repair:
            return f"{self.name}: rewrites every length and checksum; hosts receive trimmed packets as they are"
        return (f"{self.name}: leaves {', '.join(f.replace('_', ' ') for f in self.stale)} stale; "
                "trimlab's receive repair on each NIC host makes them valid")


def _ranges(qs: list[int]) -> str:
    return f"{min(qs)}..{max(qs)}" if qs == list(range(min(qs), max(qs) + 1)) else ", ".join(map(str, qs))


@functools.cache
def catalog() -> dict[str, Platform]:
    doc = yaml.safe_load(resources.data("switch_configs", "platforms.yml").read_text())
    return {name: Platform(name=name, **body) for name, body in doc.items()}


def get(name: str, where: str = "platform") -> Platform:
    try:
        return catalog()[name]
    except KeyError:
        raise SpecError(f"{where}={name!r}: unknown switch platform; use one of "
                        f"{', '.join(catalog())}") from None


def for_switch(name: str, os_: str, host_vars: dict) -> Platform:
    """The platform the inventory names for a switch (trim_switch_platform), else its OS's
    default; a platform that the switch's OS does not run is an error naming both."""
    p = get(host_vars.get("trim_switch_platform", DEFAULT_FOR_OS[os_]), f"switch {name}: trim_switch_platform")
    if os_ not in p.targets:
        raise SpecError(f"switch {name}: trim_switch_platform={p.name!r} does not run trim_switch_os={os_}; "
                        f"{p.name} runs {', '.join(p.targets)}")
    return p
