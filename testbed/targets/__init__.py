"""Switch targets: one driver interface, one driver per switch OS (NAPALM's pattern).

    target = get_target("sonic")
    target.check(profile, ports)            # the OS's own limits, before anything is sent
    rendered = target.render(profile, ports)  # config data + CLI lines, from Jinja2 templates

The templates live in switch_configs/<target>/; a driver only prepares their context.
"""

from __future__ import annotations

from trimlab.errors import SpecError
from trimlab.testbed.targets.base import Port, Rendered, SwitchTarget
from trimlab.testbed.targets.cumulus import Cumulus
from trimlab.testbed.targets.sonic import Sonic
from trimlab.testbed.targets.vswitch import VSwitchTarget

TARGETS: dict[str, type[SwitchTarget]] = {t.name: t for t in (Sonic, Cumulus, VSwitchTarget)}


def get_target(name: str) -> SwitchTarget:
    try:
        return TARGETS[name]()
    except KeyError:
        raise SpecError(f"trim_switch_os={name!r}: unknown switch target; use one of "
                        f"{', '.join(TARGETS)}") from None


__all__ = ["TARGETS", "Port", "Rendered", "SwitchTarget", "get_target"]
