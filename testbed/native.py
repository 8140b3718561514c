"""Small native helpers compiled on first use and cached by the hash of source and flags
(the eBPF switch program, the load generator, the capture walker)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from trimlab.errors import TrimlabError


class BuildError(TrimlabError):
    """A native helper could not be compiled."""


def cache_dir() -> Path:
    return Path(os.environ.get("TRIMLAB_CACHE", "/var/cache/trimlab"))


def build(source: Path, compiler: str, flags: list[str], name: str, suffix: str = "") -> Path:
    """`compiler flags source -o CACHE/name-HASH{suffix}`, once per source and flags."""
    exe = shutil.which(compiler)
    if not exe:
        raise BuildError(f"{compiler} not found: apt-get install {compiler} (or make setup)")
    digest = hashlib.sha256(source.read_bytes() + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{digest}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    done = subprocess.run([exe, *flags, str(source), "-o", str(tmp)], capture_output=True, text=True)
    if done.returncode:
        raise BuildError(f"compiling {source.name} failed: {done.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out
