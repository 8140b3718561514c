"""The receive repair on a NIC host's data interface (repair.c): install, remove, read.

Real trimming switches leave a trimmed packet's IP and UDP lengths and checksums stale, so
the host kernel drops it before any socket. The repair, a tc ingress program, makes
trimlab's trimmed gradient datagrams valid again and counts them. It is attached under
clsact with its own preference and a handle that holds its UDP port, and holds no bpffs
pin: removing the filter removes everything (`trimlab host repair remove`).

    python -m trimlab.agents.repair install --dev eth1 [--port 47000]
    python -m trimlab.agents.repair status --dev eth1      # JSON: port, counters
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys

from trimlab import native, resources
from trimlab.config import GRADIENT_PORT
from trimlab.errors import TrimlabError

SOURCE = resources.c_source("agents", "repair.c")
PREF = 7  # the filter's preference on clsact ingress: trimlab's repair, nothing else
COUNTERS = ("seen", "repaired", "refused")  # repair.c's counter indexes, in order


class RepairError(TrimlabError):
    """The receive repair cannot be built, attached or read."""


def _sh(*cmd: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    full = (["nsenter", f"--net=/run/netns/{ns}"] if ns else []) + list(cmd)
    out = subprocess.run(full, capture_output=True, text=True)
    if check and out.returncode:
        raise RepairError(f"`{' '.join(full)}` failed: {out.stderr.strip()}")
    return out


def build(port: int = GRADIENT_PORT):
    try:
        return native.build(SOURCE, "clang", native.bpf_cflags() + ["-Wall", "-c", f"-DREPAIR_PORT={port}"],
                            "repair", ".o", headers=(native.BPF_CSUM_H,))
    except native.BuildError as exc:
        raise RepairError(f"{exc} (clang, llvm and libbpf-dev are needed)") from None


def install(dev: str, port: int = GRADIENT_PORT, ns: str | None = None) -> None:
    """Attach the repair for gradient datagrams to `port` on `dev` (replacing any)."""
    if not 1 <= port <= 65535:
        raise RepairError(f"port={port}: a UDP port is 1..65535")
    obj = build(port)
    _sh("tc", "qdisc", "replace", "dev", dev, "clsact", ns=ns)
    remove(dev, ns)  # a filter's handle cannot change in place
    _sh("tc", "filter", "add", "dev", dev, "ingress", "pref", str(PREF), "handle", hex(port), "bpf",
        "direct-action", "object-file", str(obj), "section", "tc", ns=ns)


def remove(dev: str, ns: str | None = None) -> None:
    _sh("tc", "filter", "del", "dev", dev, "ingress", "pref", str(PREF), ns=ns, check=False)


def status(dev: str, ns: str | None = None) -> dict | None:
    """{"port", "prog_id", "counters": {seen, repaired, refused}}, or None when `dev` has no
    repair; counters None (and counters_error) where this user may not read them."""
    shown = _sh("tc", "filter", "show", "dev", dev, "ingress", "pref", str(PREF), ns=ns, check=False).stdout
    m = re.search(r"handle (0x[0-9a-f]+) .* id (\d+) name trimlab_repair", shown)
    if not m:
        return None
    out = {"port": int(m.group(1), 16), "prog_id": int(m.group(2)), "counters": None}
    try:  # reading a program's maps needs root (CAP_BPF); seeing the filter does not
        out["counters"] = _counters(m.group(2), dev)
    except RepairError as exc:
        out["counters_error"] = str(exc)
    return out


def _counters(prog_id: str, dev: str) -> dict[str, int]:
    prog = json.loads(_sh("bpftool", "-j", "prog", "show", "id", prog_id).stdout)
    maps = [json.loads(_sh("bpftool", "-j", "map", "show", "id", str(i)).stdout) for i in prog.get("map_ids", [])]
    ids = [mp["id"] for mp in maps if mp.get("name") == "counters"]
    if not ids:
        raise RepairError(f"{dev}: the repair program {prog_id} has no counters map")
    dump = json.loads(_sh("bpftool", "-j", "map", "dump", "id", str(ids[0])).stdout)
    values = [0] * len(COUNTERS)
    for e in dump:
        f = e.get("formatted", e)
        k, v = f["key"], f["value"]
        if isinstance(k, list):  # raw bytes, when the map has no BTF
            k = int.from_bytes(bytes(int(b, 16) for b in k), "little")
            v = int.from_bytes(bytes(int(b, 16) for b in v), "little")
        if k < len(values):
            values[k] = int(v)
    return dict(zip(COUNTERS, values))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trimlab-repair", description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=("install", "remove", "status"))
    ap.add_argument("--dev", required=True, help="the data interface")
    ap.add_argument("--port", type=int, default=GRADIENT_PORT, help="UDP port of gradient datagrams")
    a = ap.parse_args(argv)
    try:
        if a.action == "install":
            install(a.dev, a.port)
        elif a.action == "remove":
            remove(a.dev)
        print(json.dumps(status(a.dev)))
    except TrimlabError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
