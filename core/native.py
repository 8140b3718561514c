"""Small native helpers compiled on first use and cached by the hash of source and flags
(the eBPF switch program, the load generator, the capture walker), and the CPU-specific
libraries (the codec kernels, the receive path), built for an instruction set level that
the running CPU supports and checked against it when they load.

Why levels instead of `-march=native`: a cache shared by hosts of different CPUs (a golden
image, an NFS home, a container built elsewhere) would hand one host a library built for
another's vector units, and the first AVX-512 instruction kills the agent with SIGILL.
Here the level is part of the cache key and of the file name, each library carries the
level it was built for (`tl_built_for`, a string read before any of its code runs), and a
library whose level the host cannot execute is rebuilt, never called.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from trimlab import resources
from trimlab.errors import TrimlabError


class BuildError(TrimlabError):
    """A native helper could not be compiled."""


class IsaError(TrimlabError):
    """TRIMLAB_ISA names a level that does not exist or that this CPU cannot run."""


def cache_dir() -> Path:
    return Path(os.environ.get("TRIMLAB_CACHE", "/var/cache/trimlab"))


def build(source: Path, compiler: str, flags: list[str], name: str, suffix: str = "",
          extra: tuple[Path, ...] = (), headers: tuple[Path, ...] = ()) -> Path:
    """`compiler flags source extra... -o CACHE/name-HASH{suffix}`, once per sources, the
    headers they include (found with -I each header's folder) and flags."""
    exe = shutil.which(compiler)
    if not exe:
        raise BuildError(f"{compiler} not found: apt-get install {compiler} (or make setup)")
    flags = [*flags, *(f"-I{d}" for d in dict.fromkeys(str(h.parent) for h in headers))]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in (source, *extra, *headers))
                            + " ".join(flags).encode()).hexdigest()[:16]
    out = cache_dir() / f"{name}-{digest}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
    done = subprocess.run([exe, *flags, str(source), *map(str, extra), "-o", str(tmp)],
                          capture_output=True, text=True)
    if done.returncode:
        raise BuildError(f"compiling {source.name} failed: {done.stderr.strip()[-400:]}")
    tmp.replace(out)
    return out


def bpf_cflags() -> list[str]:
    """clang flags for tc BPF objects: the multiarch include dir holds asm/types.h."""
    try:
        triple = subprocess.run(["gcc", "-dumpmachine"], capture_output=True, text=True,
                                check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        triple = os.uname().machine + "-linux-gnu"
    return ["-O2", "-g", "-target", "bpf", f"-I/usr/include/{triple}"]


BPF_CSUM_H = resources.c_source("agents", "bpf_csum.h")  # checksum helpers of the tc programs


# --- instruction set levels ---------------------------------------------------------------

# the x86-64 psABI levels, as /proc/cpuinfo names the features each lets gcc emit
_X86_V2 = frozenset({"cx16", "lahf_lm", "popcnt", "sse4_1", "sse4_2", "ssse3"})
_X86_V3 = _X86_V2 | {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}
_X86_V4 = _X86_V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class Isa:
    """One build target: the CPU features it needs (cpuinfo's names) and gcc's flags for it."""

    name: str
    title: str
    needs: frozenset[str]
    flags: tuple[str, ...]


# from the most capable; `plain` is the compiler's baseline for the machine (any x86-64, any aarch64)
X86_ISAS = (
    Isa("avx512-gfni", "AVX-512 with GFNI and VBMI", _X86_V4 | {"gfni", "avx512vbmi"},
        ("-march=x86-64-v4", "-mgfni", "-mavx512vbmi")),
    Isa("avx512", "AVX-512 (F, BW, CD, DQ, VL)", _X86_V4, ("-march=x86-64-v4",)),
    Isa("avx2", "AVX2 with FMA", _X86_V3, ("-march=x86-64-v3",)),
)
PLAIN = Isa("plain", "no vector extensions (portable C)", frozenset(), ())
ISAS = {isa.name: isa for isa in (*X86_ISAS, PLAIN)}


def _is_x86(machine: str) -> bool:
    return machine.lower() in ("x86_64", "amd64")


def host_features() -> frozenset[str]:
    """The running CPU's feature flags, as the kernel reports them (empty where unknown),
    less those named in TRIMLAB_CPU_FEATURES_OFF: a host without AVX-512 can be rehearsed
    on one with it (`TRIMLAB_CPU_FEATURES_OFF=avx512f`); features can only be taken away."""
    return _cpu_flags() - frozenset(os.environ.get("TRIMLAB_CPU_FEATURES_OFF", "").replace(",", " ").split())


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def runnable(features: frozenset[str] | None = None, machine: str | None = None) -> list[Isa]:
    """The levels a CPU with `features` can execute, the most capable first (plain last)."""
    features = host_features() if features is None else features
    machine = platform.machine() if machine is None else machine
    vec = [isa for isa in X86_ISAS if isa.needs <= features] if _is_x86(machine) else []
    return [*vec, PLAIN]


def choose(features: frozenset[str] | None = None, machine: str | None = None,
           cap: str | None = None) -> Isa:
    """The level to build for: the best the CPU runs, or `cap` (TRIMLAB_ISA) when it asks
    for less. A cap the CPU cannot run is an error: that path is never executed here."""
    levels = runnable(features, machine)
    cap = os.environ.get("TRIMLAB_ISA", "") if cap is None else cap
    if not cap:
        return levels[0]
    if cap not in ISAS:
        raise IsaError(f"TRIMLAB_ISA={cap!r}: choose one of {', '.join(ISAS)}")
    if ISAS[cap] not in levels:
        raise IsaError(f"TRIMLAB_ISA={cap}: this CPU cannot run it (it runs "
                         f"{', '.join(i.name for i in levels)}); unset TRIMLAB_ISA or pick one of those")
    return ISAS[cap]


_STAMP = "trimlab-isa:"


def _stamp_source(isa: Isa) -> Path:
    """A one-line C file naming the level a library is built for (data only: no code)."""
    path = cache_dir() / f"built-for-{isa.name}.c"
    text = f'const char tl_built_for[] = "{_STAMP}{isa.name}";\n'
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        tmp.replace(path)
    return path


def built_for(path: Path) -> str | None:
    """The level recorded in a library's bytes, read without loading it (None: unstamped)."""
    found = re.search(re.escape(_STAMP).encode() + rb"([a-z0-9-]+)\0", path.read_bytes())
    return found.group(1).decode() if found else None


def build_library(source: Path, name: str, flags: list[str], isa: Isa) -> Path:
    """Compile `source` as a shared library for `isa` (any level: compiling runs nothing),
    stamped with the level; cached under a name that carries it."""
    return build(source, "gcc", [*flags, *isa.flags], f"{name}-{isa.name}", ".so", extra=(_stamp_source(isa),))


def load_library(source: Path, name: str, flags: list[str], isa: Isa | None = None,
                 features: frozenset[str] | None = None) -> tuple[ctypes.CDLL, Isa]:
    """Build `source` for `isa` (default: choose()) and load it, after checking that the
    library is stamped with a level this CPU runs; one that is not (a cache written by
    another host) is rebuilt, never loaded."""
    isa = isa or choose(features)
    features = host_features() if features is None else features
    if isa not in runnable(features):
        raise IsaError(f"{name}: the {isa.name} build needs CPU features this host lacks: "
                       f"{' '.join(sorted(isa.needs - features))}")
    path = build_library(source, name, flags, isa)
    if built_for(path) != isa.name:
        path.unlink(missing_ok=True)
        path = build_library(source, name, flags, isa)
        if built_for(path) != isa.name:
            raise BuildError(f"{path}: built for {built_for(path)}, not {isa.name}; remove {cache_dir()}")
    return ctypes.CDLL(str(path)), isa
