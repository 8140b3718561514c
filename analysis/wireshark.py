"""The Wireshark / tshark dissector shipped with trimlab (analysis/trimlab.lua): where it
is, and installing it into the user's personal Lua plugin folder."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from trimlab import resources


def plugin_path() -> Path:
    return resources.data("analysis", "trimlab.lua")


def personal_plugin_dir() -> Path:
    """Wireshark's "Personal Lua Plugins" folder as tshark reports it (`tshark -G folders`),
    else its documented default for this OS."""
    tshark = shutil.which("tshark")
    if tshark:
        out = subprocess.run([tshark, "-G", "folders"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Personal Lua Plugins" and value.strip():
                return Path(value.strip())
    if os.name == "nt":
        return Path(os.environ.get("APPDATA", Path.home())) / "Wireshark" / "plugins"
    return Path.home() / ".local" / "lib" / "wireshark" / "plugins"


def install(folder: Path | None = None) -> Path:
    """Copy the dissector into `folder` (default: the personal Lua plugin folder); returns
    the installed file. A copy, not a link: it outlives the environment it came from."""
    folder = folder or personal_plugin_dir()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / plugin_path().name
    shutil.copyfile(plugin_path(), target)
    return target
