"""Package data: profiles, templates, playbooks, experiment specs, the example DDP script
and the C sources, found through importlib.resources, so that a wheel install and the
source tree behave the same. Users add their own profile and spec folders with
TRIMLAB_PROFILES and TRIMLAB_EXPERIMENTS (os.pathsep-separated, searched first)."""

from __future__ import annotations

import os
from importlib.resources import files
from pathlib import Path


def data(package: str, *parts: str) -> Path:
    """A file or folder shipped in `trimlab.<package>` (installed as plain files)."""
    return Path(str(files(f"trimlab.{package}").joinpath(*parts)))


def search_path(env: str, package: str, *parts: str) -> list[Path]:
    """The user's folders from `env`, then the packaged one."""
    users = [Path(p) for p in os.environ.get(env, "").split(os.pathsep) if p]
    return [*users, data(package, *parts)]


def profile_dirs() -> list[Path]:
    return search_path("TRIMLAB_PROFILES", "switch_configs", "profiles")


def experiment_dirs() -> list[Path]:
    return search_path("TRIMLAB_EXPERIMENTS", "experiments")


def templates() -> Path:
    return data("switch_configs")


def playbooks() -> Path:
    return data("playbooks")


def example_ddp_script() -> Path:
    return data("examples", "ddp_train.py")


def c_source(package: str, name: str) -> Path:
    return data(package, name)
