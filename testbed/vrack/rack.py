"""The virtual rack: hosts and one switch as network namespaces on this machine, reached
over SSH on a management bridge, cabled to an eBPF trimming switch on the data network.

Every object is named tl<id>-…, so racks with different ids coexist and leftovers are
recognisable; `down_all` removes every tl* namespace, link, bpf pin and the processes in
them even when the state file is gone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from trimlab.config import parse_rate
from trimlab.errors import SpecError, TrimlabError
from trimlab.vrack import vswitch

BPF_ROOT = Path("/sys/fs/bpf")
DATA_V4 = "198.19.0"
DATA_V6 = "fd00:7472::"
SSHD_PORT = 22
ID_RE = re.compile(r"^[a-z0-9]{1,6}$")


class RackError(TrimlabError):
    """The rack cannot be built, found or reached."""


def racks_dir() -> Path:
    return Path(os.environ.get("TRIMLAB_HOME", "/var/lib/trimlab")) / "racks"


def _run(*cmd: str, check: bool = True, ns: str | None = None, timeout: float = 30):
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    out = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    if check and out.returncode:
        raise RackError(f"`{' '.join(full)}` failed: {out.stderr.strip()}")
    return out


@dataclass
class Host:
    name: str  # w1, ps1, tr1, sw
    role: str  # worker | ps | traffic | switch
    ns: str
    mgmt_ip: str
    mgmt_link: str  # root-namespace end of the management veth
    data_ipv4: str = ""
    data_ipv6: str = ""
    port: str = ""  # switch port this host is cabled to
    port_index: int = -1


@dataclass
class RackState:
    id: str
    slot: int  # management subnet 198.18.<slot>.0/24
    rate_bps: int
    mtu: int
    delay_ms: float
    hosts: list[Host] = field(default_factory=list)
    created: float = 0.0

    @property
    def dir(self) -> Path:
        return racks_dir() / self.id

    @property
    def inventory(self) -> Path:
        """The Ansible inventory `rack up` writes (the shape a physical lab uses)."""
        return self.dir / "inventory.yml"

    @property
    def pin_dir(self) -> Path:
        return BPF_ROOT / f"tl{self.id}"

    @property
    def bridge(self) -> str:
        return f"tl{self.id}-br"

    @property
    def switch(self) -> Host:
        return next(h for h in self.hosts if h.role == "switch")

    @property
    def nic_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.role != "switch"]

    @property
    def ports(self) -> list[str]:
        return [h.port for h in self.nic_hosts]

    def vswitch(self) -> "vswitch.VSwitch":
        return vswitch.VSwitch(self.pin_dir, self.ports, self.mtu, ns=self.switch.ns)

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "state.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(self.dir / "state.json")

    @classmethod
    def load(cls, rack_id: str) -> "RackState":
        path = racks_dir() / rack_id / "state.json"
        if not path.exists():
            known = ", ".join(list_ids()) or "none"
            raise RackError(f"rack {rack_id!r} is not up (no {path}); racks up: {known}. "
                            f"Start one with `trimlab rack up --id {rack_id}`")
        raw = json.loads(path.read_text())
        raw["hosts"] = [Host(**h) for h in raw["hosts"]]
        return cls(**raw)


def list_ids() -> list[str]:
    d = racks_dir()
    return sorted(p.name for p in d.iterdir() if (p / "state.json").exists()) if d.exists() else []


def resolve(rack_id: str | None) -> RackState:
    """The rack named, or the only one up."""
    if rack_id:
        return RackState.load(rack_id)
    ids = list_ids()
    if len(ids) != 1:
        raise RackError("no virtual rack is up: start one with `trimlab rack up`" if not ids else
                        f"several racks are up ({', '.join(ids)}): choose one with --id")
    return RackState.load(ids[0])


def _free_slot() -> int:
    used = set()
    for rid in list_ids():
        try:
            used.add(RackState.load(rid).slot)
        except (RackError, TypeError, KeyError, json.JSONDecodeError):
            pass
    addrs = _run("ip", "-4", "-o", "addr", "show", check=False).stdout
    used |= {int(m) for m in re.findall(r"inet 198\.18\.(\d+)\.", addrs)}
    for slot in range(256):
        if slot not in used:
            return slot
    raise RackError("every management subnet 198.18.0-255.0/24 is taken: take racks down first")


def plan(rack_id: str, workers: int, ps: int, traffic: int, rate: str, mtu: int,
         delay_ms: float) -> RackState:
    """Validate the options and lay out names and addresses (nothing is touched)."""
    if not ID_RE.match(rack_id):
        raise SpecError(f"id={rack_id!r}: use 1 to 6 lowercase letters or digits")
    if not 1 <= workers <= 32:
        raise SpecError(f"workers={workers}: use 1..32")
    if ps not in (0, 1) or traffic not in (0, 1, 2):
        raise SpecError(f"ps={ps}, traffic={traffic}: a rack has 0 or 1 ps and 0..2 traffic hosts")
    if not 1280 <= mtu <= 9000:
        raise SpecError(f"mtu={mtu}: use 1280..9000")
    if not 0 <= delay_ms <= 1000:
        raise SpecError(f"delay={delay_ms}: use 0..1000 ms")
    bps = parse_rate(rate)
    if not 1_000_000 <= bps <= 100_000_000_000:
        raise SpecError(f"rate={rate!r}: use 1mbit..100gbit")
    if (racks_dir() / rack_id / "state.json").exists():
        raise RackError(f"rack {rack_id!r} is already up: `trimlab rack down --id {rack_id}` first")
    st = RackState(id=rack_id, slot=_free_slot(), rate_bps=bps, mtu=mtu, delay_ms=delay_ms,
                   created=time.time())
    net = f"198.18.{st.slot}"
    st.hosts.append(Host("sw", "switch", f"tl{rack_id}-sw", f"{net}.2", f"tl{rack_id}-m0"))
    names = ([(f"w{i}", "worker") for i in range(1, workers + 1)]
             + [(f"ps{i}", "ps") for i in range(1, ps + 1)]
             + [(f"tr{i}", "traffic") for i in range(1, traffic + 1)])
    for i, (name, role) in enumerate(names):
        octet = 10 + i
        st.hosts.append(Host(name, role, f"tl{rack_id}-{name}", f"{net}.{octet}",
                             f"tl{rack_id}-m{i + 1}", f"{DATA_V4}.{octet}", f"{DATA_V6}{octet:x}",
                             f"Ethernet{4 * i}", i))
    return st


# -- bring-up steps -------------------------------------------------------------------------

def _keys(st: RackState) -> None:
    kdir = st.dir / "keys"
    kdir.mkdir(parents=True, exist_ok=True)
    os.chmod(st.dir, 0o700)
    client = kdir / "id_ed25519"
    if not client.exists():
        _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"trimlab-{st.id}", "-f", str(client))
    (kdir / "authorized_keys").write_text(Path(f"{client}.pub").read_text())
    lines = []
    for h in st.hosts:
        key = kdir / f"{h.name}_host_ed25519"
        if not key.exists():
            _run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{h.ns}", "-f", str(key))
        pub = Path(f"{key}.pub").read_text().split()
        lines.append(f"{h.mgmt_ip} {pub[0]} {pub[1]}")
    (st.dir / "known_hosts").write_text("\n".join(lines) + "\n")


def _sshd_config(st: RackState, h: Host) -> Path:
    kdir = st.dir / "keys"
    conf = st.dir / "run" / f"sshd_{h.name}.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text("\n".join([
        f"ListenAddress {h.mgmt_ip}", f"Port {SSHD_PORT}",
        f"HostKey {kdir / f'{h.name}_host_ed25519'}",
        f"PidFile {st.dir / 'run' / f'sshd_{h.name}.pid'}",
        f"AuthorizedKeysFile {kdir / 'authorized_keys'}",
        "PermitRootLogin prohibit-password", "PasswordAuthentication no",
        "KbdInteractiveAuthentication no", "UsePAM no", "StrictModes no", "UseDNS no",
        "Subsystem sftp internal-sftp", "AcceptEnv TRIMLAB_* LANG", "LogLevel ERROR",
        "ClientAliveInterval 10", "MaxStartups 64:30:128", "",
    ]))
    return conf


def _host_nic(ns: str, dev: str, rate_bps: int, delay_ms: float) -> None:
    """Host NIC egress at line rate; a delay needs sch_netem, which some kernels lack."""
    if delay_ms:
        out = _run("tc", "qdisc", "replace", "dev", dev, "root", "netem", "delay",
                   f"{delay_ms}ms", "rate", f"{rate_bps}bit", "limit", "10000", ns=ns, check=False)
        if out.returncode:
            raise RackError(f"delay={delay_ms}: this kernel has no sch_netem ({out.stderr.strip()}); "
                            "use --delay 0")
        return
    rate = f"{rate_bps}bit"
    _run("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "1", ns=ns)
    _run("tc", "class", "replace", "dev", dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate,
         "ceil", rate, "burst", "15k", "cburst", "15k", ns=ns)
    # Deep enough that a sender's socket buffer, not the qdisc, pushes back, as a NIC would.
    _run("tc", "qdisc", "replace", "dev", dev, "parent", "1:1", "handle", "2:", "pfifo",
         "limit", "20000", ns=ns)


def up(st: RackState) -> RackState:
    """Build everything in `st`; on any failure, take down what was built."""
    st.save()  # first, so that `down` finds a half-built rack
    try:
        _keys(st)
        _run("ip", "link", "add", st.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"198.18.{st.slot}.1/24", "dev", st.bridge)
        _run("ip", "link", "set", st.bridge, "up")
        sw = st.switch
        for h in st.hosts:
            _run("ip", "netns", "add", h.ns)
            _run("ip", "link", "set", "lo", "up", ns=h.ns)
            _run("ip", "link", "add", h.mgmt_link, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _run("ip", "link", "set", h.mgmt_link, "master", st.bridge, "up")
            _run("ip", "addr", "add", f"{h.mgmt_ip}/24", "dev", "eth0", ns=h.ns)
            _run("ip", "link", "set", "eth0", "up", ns=h.ns)
        _run("ip", "link", "add", "br0", "type", "bridge", ns=sw.ns)
        _run("ip", "link", "set", "br0", "up", ns=sw.ns)
        for h in st.nic_hosts:
            _run("ip", "link", "add", h.port, "netns", sw.ns, "mtu", str(st.mtu), "type", "veth",
                 "peer", "name", "eth1", "netns", h.ns, "mtu", str(st.mtu))
            _run("ip", "link", "set", h.port, "master", "br0", "up", ns=sw.ns)
            _run("ip", "addr", "add", f"{h.data_ipv4}/24", "dev", "eth1", ns=h.ns)
            _run("ip", "-6", "addr", "add", f"{h.data_ipv6}/64", "dev", "eth1", "nodad", ns=h.ns)
            _run("ip", "link", "set", "eth1", "up", ns=h.ns)
            # Real checksums on the data path: a trimmed packet must carry a correct one.
            # Without checksum offload the kernel also drops UDP segmentation offload, so
            # a UDP GSO send is segmented before eth1: the switch sees wire packets only.
            _run("ethtool", "-K", "eth1", "tx", "off", "rx", "off", ns=h.ns)
            _run("ethtool", "-K", h.port, "tx", "off", "rx", "off", ns=sw.ns)
            _host_nic(h.ns, "eth1", st.rate_bps, st.delay_ms)
        vswitch.load(st.pin_dir)
        for h in st.nic_hosts:
            vswitch.attach(sw.ns, h.port, _ifindex(sw.ns, h.port), h.port_index, st.pin_dir,
                           st.rate_bps)
        st.vswitch().write(vswitch.default_config(st.ports, st.rate_bps // 1_000_000))
        Path("/run/sshd").mkdir(exist_ok=True)
        for h in st.hosts:
            if h.role == "switch":  # its sessions run `trimlab switch`: they need /sys/fs/bpf,
                # which `ip netns exec` hides by remounting /sys
                _run("nsenter", f"--net=/run/netns/{h.ns}", "/usr/sbin/sshd", "-f", str(_sshd_config(st, h)))
            else:
                _run("/usr/sbin/sshd", "-f", str(_sshd_config(st, h)), ns=h.ns)
        write_inventory(st)
        _wait_ssh(st)
    except BaseException:
        down(st)
        raise
    return st


def _ifindex(ns: str, dev: str) -> int:
    out = _run("ip", "-j", "link", "show", dev, ns=ns).stdout
    return int(json.loads(out)[0]["ifindex"])


def sshd_banner(ip: str, timeout: float = 1.0) -> str:
    try:
        with socket.create_connection((ip, SSHD_PORT), timeout=timeout) as s:
            return s.recv(64).decode(errors="replace").strip()
    except OSError:
        return ""


def _wait_ssh(st: RackState, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    pending = list(st.hosts)
    while pending and time.monotonic() < deadline:
        pending = [h for h in pending if not sshd_banner(h.mgmt_ip).startswith("SSH-")]
        if pending:
            time.sleep(0.1)
    if pending:
        raise RackError(f"sshd did not answer on {', '.join(h.name + ' ' + h.mgmt_ip for h in pending)}")


def write_inventory(st: RackState) -> Path:
    """The Ansible YAML inventory: the same shape a physical lab rack uses."""
    keys = st.dir / "keys"
    inv = {"all": {
        "vars": {
            "ansible_user": "root",
            "ansible_ssh_private_key_file": str(keys / "id_ed25519"),
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={st.dir / 'known_hosts'} "
                                       "-o StrictHostKeyChecking=yes",
            "ansible_python_interpreter": sys.executable,
            "trimlab_rack_id": st.id,
            "trimlab_virtual": True,
            "trimlab_python": sys.executable,
            "trimlab_cli": str(Path(sys.executable).with_name("trimlab")),
            "data_mtu": st.mtu,
        },
        "children": {
            "trim_switches": {"hosts": {st.switch.ns: {
                "ansible_host": st.switch.mgmt_ip,
                "trim_switch_os": "vswitch",
                "ports": {h.port: {"host": h.ns, "facing": "host",
                                   "speed_mbps": st.rate_bps // 1_000_000} for h in st.nic_hosts},
            }}},
            "nic_hosts": {"hosts": {h.ns: {
                "ansible_host": h.mgmt_ip, "role": h.role, "data_if": "eth1",
                "data_ipv4": h.data_ipv4, "data_ipv6": h.data_ipv6, "switch_port": h.port,
            } for h in st.nic_hosts}},
        },
    }}
    path = st.inventory
    path.write_text(f"# trimlab virtual rack {st.id}: written by `trimlab rack up`\n"
                    + yaml.safe_dump(inv, sort_keys=False))
    return path


# -- status and tear-down --------------------------------------------------------------------

def status(st: RackState) -> dict:
    nss = set(_netns_list())
    prog = _run("tc", "filter", "show", "dev", st.ports[0], "egress", ns=st.switch.ns,
                check=False).stdout if st.switch.ns in nss and st.ports else ""
    return {
        "id": st.id, "inventory": str(st.inventory), "mgmt": f"198.18.{st.slot}.0/24",
        "rate_bps": st.rate_bps, "mtu": st.mtu, "delay_ms": st.delay_ms,
        "switch_program": "trimlab_egress" in prog,
        "hosts": [{"name": h.name, "role": h.role, "ns": h.ns, "mgmt_ip": h.mgmt_ip,
                   "data_ipv4": h.data_ipv4, "data_ipv6": h.data_ipv6, "port": h.port,
                   "namespace": h.ns in nss, "sshd": sshd_banner(h.mgmt_ip).startswith("SSH-")}
                  for h in st.hosts],
    }


def _netns_list() -> list[str]:
    return [line.split()[0] for line in _run("ip", "netns", "list", check=False).stdout.splitlines()
            if line.strip()]


def alive(pid: int) -> bool:
    """A process exists and is not a zombie (exited daemons wait for init to reap them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill_namespace_processes(ns: str) -> None:
    """Every process in a namespace of ours is ours (sshd, agents): stop them by PID."""
    pids = [int(p) for p in _run("ip", "netns", "pids", ns, check=False).stdout.split()]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 2
        while pids and time.monotonic() < deadline:
            pids = [p for p in pids if alive(p)]
            if pids:
                time.sleep(0.05)
        if not pids:
            return


def _remove(prefix: str) -> None:
    for ns in _netns_list():
        if ns.startswith(prefix):
            _kill_namespace_processes(ns)
            _run("ip", "netns", "del", ns, check=False)
    links = _run("ip", "-o", "link", "show", check=False).stdout
    for name in re.findall(r"^\d+:\s+([^:@\s]+)", links, flags=re.M):
        if name.startswith(prefix):
            _run("ip", "link", "del", name, check=False)


def _kill_pidfiles(run_dir: Path) -> None:
    for pidfile in run_dir.glob("*.pid") if run_dir.exists() else []:
        try:
            pid = int(pidfile.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if any(tag in cmdline for tag in (b"trimlab", b"testbed", b"sshd")):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass


def down(st: RackState) -> None:
    """Remove everything of rack `st`: processes, namespaces, links, pins, its directory."""
    _kill_pidfiles(st.dir / "run")
    _remove(f"tl{st.id}-")
    vswitch.unpin(st.pin_dir)
    if st.dir.exists():
        shutil.rmtree(st.dir, ignore_errors=True)


def down_all() -> list[str]:
    """Remove every tl* namespace, link, bpf pin and rack directory, state file or not."""
    ids = list_ids()
    for d in racks_dir().glob("*") if racks_dir().exists() else []:
        _kill_pidfiles(d / "run")
    _remove("tl")
    for pin in BPF_ROOT.glob("tl*") if BPF_ROOT.exists() else []:
        vswitch.unpin(pin)
    if racks_dir().exists():
        for d in racks_dir().iterdir():
            shutil.rmtree(d, ignore_errors=True)
    return ids
