"""`trimlab doctor`: is this machine able to run a virtual rack? Each check says what is
missing and the command that fixes it. Kernel checks are real: they create a scratch
network namespace, attach a clsact qdisc and a compiled tc BPF program, and remove it."""

from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from trimlab import native
from trimlab.errors import TrimlabError

PYTHON_DEPS = ("torch", "numpy", "scapy", "pydantic", "typer", "rich", "yaml")
TOOLS = {  # command -> Debian package
    "ip": "iproute2", "tc": "iproute2", "clang": "clang", "llc": "llvm", "bpftool": "bpftool",
    "sshd": "openssh-server", "ssh-keygen": "openssh-client", "tcpdump": "tcpdump",
    "ethtool": "ethtool", "nsenter": "util-linux",
}
SBIN = ("/usr/sbin", "/sbin", "/usr/local/sbin")

_PASS_PROG = r"""
#include <linux/bpf.h>
#include <linux/pkt_cls.h>
__attribute__((section("tc"), used)) int doctor_pass(struct __sk_buff *skb) { return TC_ACT_OK; }
char _license[] __attribute__((section("license"), used)) = "GPL";
"""


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str = ""
    required: bool = True


def which(cmd: str) -> str | None:
    path = os.environ.get("PATH", "") + os.pathsep + os.pathsep.join(SBIN)
    return shutil.which(cmd, path=path)


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def _kernel_checks() -> list[Check]:
    """netns + clsact + a real tc BPF program, in a scratch namespace removed afterwards."""
    ns = f"tldoc{os.getpid() % 100000}"
    checks = []
    created = _run("ip", "netns", "add", ns)
    try:
        checks.append(Check("network namespaces", created.returncode == 0,
                            "created and removed a scratch namespace" if created.returncode == 0
                            else created.stderr.strip(), "run as root on a kernel with CONFIG_NET_NS"))
        if created.returncode:
            return checks
        htb = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "root", "htb")
        checks.append(Check("tc htb", htb.returncode == 0, htb.stderr.strip() or "htb attached",
                            "a kernel with CONFIG_NET_SCH_HTB (port rates and priority bands)"))
        qd = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "lo", "clsact")
        checks.append(Check("tc clsact", qd.returncode == 0, qd.stderr.strip() or "clsact attached",
                            "a kernel with CONFIG_NET_SCH_INGRESS (clsact)"))
        clang = which("clang")
        if qd.returncode or not clang:
            checks.append(Check("tc BPF program", False, "needs clsact and clang",
                                "apt-get install clang llvm libbpf-dev"))
            return checks
        with tempfile.TemporaryDirectory(prefix="trimlab-doctor-") as tmp:
            src, obj = Path(tmp, "pass.c"), Path(tmp, "pass.o")
            src.write_text(_PASS_PROG)
            cc = _run(clang, *native.bpf_cflags(), "-c", str(src), "-o", str(obj))
            if cc.returncode:
                checks.append(Check("tc BPF program", False, "clang -target bpf failed: "
                                    + cc.stderr.strip().splitlines()[-1],
                                    "apt-get install libbpf-dev linux-libc-dev gcc-multilib"))
                return checks
            att = _run("ip", "netns", "exec", ns, "tc", "filter", "add", "dev", "lo", "egress",
                       "bpf", "direct-action", "obj", str(obj), "sec", "tc")
            checks.append(Check("tc BPF program", att.returncode == 0,
                                "compiled with clang and attached on egress" if att.returncode == 0
                                else att.stderr.strip(), "a kernel with CONFIG_BPF_SYSCALL and "
                                "CONFIG_NET_CLS_BPF, and root"))
    finally:
        if created.returncode == 0:
            _run("ip", "netns", "del", ns)
    return checks


def _codec_path() -> Check:
    """Which codec path this CPU runs: the native kernels at their vector level, or torch."""
    from trimlab.codec import kernels  # heavy (torch): only when doctor runs

    levels = ", ".join(isa.name for isa in native.runnable())
    try:
        isa = kernels.isa()
    except TrimlabError as exc:
        return Check("codec path", False, f"torch reference ({exc})",
                     "apt-get install gcc (or make setup); TRIMLAB_ISA, if set, must name one of " + levels,
                     required=False)
    return Check("codec path", True, f"native kernels, {isa.name}: {isa.title} (this CPU runs {levels})")


def _stale_racks() -> Check:
    """Racks left behind by a killed or crashed run (their owner is gone)."""
    from trimlab.testbed.vrack import rack

    found = rack.stale()
    return Check("stale racks", not found,
                 "; ".join(f"{rid}: {why}" for rid, why in found.items()) or "none",
                 "trimlab rack down --stale  (removes only racks whose owner is gone)", required=False)


def _receive_repair() -> Check:
    """Every host of every rack up has the receive repair where its switch's platform
    leaves trimmed packets' lengths stale (else its kernel drops every trim)."""
    from trimlab.agents import repair
    from trimlab import platforms
    from trimlab.testbed.vrack import rack

    missing = []
    for rid in rack.list_ids():
        try:
            st = rack.RackState.load(rid)
        except (TrimlabError, OSError, ValueError):
            continue
        for h in st.nic_hosts:
            plat = platforms.get(st.platform_of(h.switch))
            if plat.needs_repair and os.path.exists(f"/run/netns/{h.ns}") and repair.status("eth1", h.ns) is None:
                missing.append(f"host {h.ns} behind {h.switch} ({plat.name}: {', '.join(plat.stale)} stale)")
    return Check("receive repair", not missing, "; ".join(missing) or "every host behind a stale-header platform has it",
                 "trimlab rack down, then rack up without --no-repair (a lab: provision with nic_host_repair: true)")


def run_checks() -> list[Check]:
    checks = [Check("root", os.geteuid() == 0, f"euid {os.geteuid()}",
                    "run as root: the virtual rack creates namespaces and loads BPF")]
    for mod in PYTHON_DEPS:
        try:
            m = importlib.import_module(mod)
            checks.append(Check(f"python: {mod}", True, getattr(m, "__version__", "present")))
        except ImportError as exc:
            checks.append(Check(f"python: {mod}", False, str(exc), "make setup"))
    for cmd, pkg in TOOLS.items():
        path = which(cmd)
        checks.append(Check(f"tool: {cmd}", path is not None, path or "not found",
                            f"apt-get install {pkg}  (or: make setup)"))
    bpffs = any(line.split()[2] == "bpf" for line in Path("/proc/mounts").read_text().splitlines()
                if line.startswith("bpf ") or " /sys/fs/bpf " in line)
    checks.append(Check("bpffs at /sys/fs/bpf", bpffs, "mounted" if bpffs else
                        "not mounted (rack up mounts it)", "mount -t bpf bpf /sys/fs/bpf",
                        required=False))
    checks.append(_codec_path())
    checks.append(_stale_racks())
    if os.geteuid() == 0:
        checks.append(_receive_repair())
    if os.geteuid() == 0 and which("ip"):
        checks.extend(_kernel_checks())
    else:
        checks.append(Check("kernel datapath", False, "needs root and iproute2",
                            "run `trimlab doctor` as root"))
    return checks
