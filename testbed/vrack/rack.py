"""The virtual rack: hosts and switches as network namespaces on this machine, reached
over SSH on a management bridge, cabled to eBPF trimming switches on the data network:
one switch (bridged, the default), or a routed leaf–spine fabric (`--leaves L --spines S`):
each leaf bridges its hosts' ports under a gateway for its hosts' prefix and routes the
other leaves' prefixes over every spine (Linux multipath, L4 hash); every port of every
switch, uplinks included, runs the trimming program, each switch with its own maps.

Every object is named tl<id>-…, so racks with different ids coexist and leftovers are
recognisable; `down_all` removes every tl* namespace, link, bpf pin and the processes in
them even when the state file is gone.
"""

from __future__ import annotations

import contextlib
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

from trimlab import rundir
from trimlab.agents import repair
from trimlab.config import REMOTE_ROOT, parse_rate
from trimlab.errors import SpecError, TrimlabError
from trimlab import platforms
from trimlab.testbed.vrack import vswitch

BPF_ROOT = Path("/sys/fs/bpf")
DATA_V4 = "198.19.0"
DATA_V6 = "fd00:7472::"
DATA_NET_V4, DATA_NET_V6 = "198.19.0.0/16", "fd00:7472::/64"  # the whole data network
LINK_V4 = "198.19.250"  # fabric uplinks: one /31 (and /127) per leaf–spine link
LINK_V6 = "fd00:7472::fa:"
UPLINK_PORT0 = 240  # a leaf's uplinks are Ethernet240, Ethernet244...: after its host ports
SSHD_PORT = 22
ID_RE = re.compile(r"^[a-z0-9]{1,6}$")
MAX_LEAVES = MAX_SPINES = 4


class RackError(TrimlabError):
    """The rack cannot be built, found or reached."""


def racks_dir() -> Path:
    return Path(os.environ.get("TRIMLAB_HOME", "/var/lib/trimlab")) / "racks"


def _run(*cmd: str, check: bool = True, ns: str | None = None, timeout: float = 30):
    full = (["ip", "netns", "exec", ns] if ns else []) + list(cmd)
    with rundir.stop_deferred():  # a stop waits for the command: cut, it could still create state after down() looked
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
    port_index: int = -1  # that port's index on its switch
    switch: str = "sw"  # the switch (leaf) it is cabled to
    gateway_ipv4: str = ""  # in a fabric: its leaf's address on its prefix
    gateway_ipv6: str = ""


@dataclass
class Uplink:
    """One leaf–spine link: a port at each end, a /31 and a /127 between them."""

    leaf: str
    leaf_port: str
    leaf_ipv4: str
    leaf_ipv6: str
    spine: str
    spine_port: str
    spine_ipv4: str
    spine_ipv6: str


@dataclass
class RackState:
    id: str
    slot: int  # management subnet 198.18.<slot>.0/24
    rate_bps: int
    mtu: int
    delay_ms: float
    hosts: list[Host] = field(default_factory=list)
    created: float = 0.0
    leaves: int = 0  # 0: one bridged switch; else a routed leaf–spine fabric
    spines: int = 0
    uplink_rate_bps: int = 0
    uplinks: list[Uplink] = field(default_factory=list)
    # the process that takes the rack down when it is done (`trimlab run`, a bench); None
    # for a rack left up on purpose (`trimlab rack up`), which never goes stale
    owner: dict | None = None
    platforms: dict[str, str] = field(default_factory=dict)  # switch -> the platform it emulates
    repair: bool = True  # the receive repair on every NIC host's data interface

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
    def fabric(self) -> bool:
        return self.leaves > 0

    @property
    def switches(self) -> list[Host]:
        return [h for h in self.hosts if h.role == "switch"]

    @property
    def switch(self) -> Host:
        """The one switch (in a fabric, the first leaf)."""
        return self.switches[0]

    def switch_named(self, name: str | None) -> Host:
        """A switch by name (sw, leaf1, spine1...); None: the only one."""
        names = [h.name for h in self.switches]
        if name is None:
            if len(names) > 1:
                raise RackError(f"rack {self.id} has switches {', '.join(names)}: choose one with --switch")
            return self.switch
        if name not in names:
            raise RackError(f"--switch {name}: rack {self.id} has switches {', '.join(names)}")
        return next(h for h in self.switches if h.name == name)

    @property
    def nic_hosts(self) -> list[Host]:
        return [h for h in self.hosts if h.role != "switch"]

    def port_rates(self, sw: str) -> dict[str, int]:
        """A switch's ports in port-index order (host ports, then uplinks) and their rates."""
        out = {h.port: self.rate_bps for h in self.nic_hosts if h.switch == sw}
        up = self.uplink_rate_bps or self.rate_bps
        out |= {u.leaf_port: up for u in self.uplinks if u.leaf == sw}
        out |= {u.spine_port: up for u in self.uplinks if u.spine == sw}
        return out

    @property
    def ports(self) -> list[str]:
        """The one switch's ports (in a fabric, the first leaf's)."""
        return list(self.port_rates(self.switch.name))

    def platform_of(self, sw: str) -> str:
        return self.platforms.get(sw, "ideal")  # a rack saved before platforms: the old switch

    def switch_pin_dir(self, sw: str) -> Path:
        """Each switch's program and maps: tl<id>/ for one switch, tl<id>/<switch>/ in a fabric."""
        return self.pin_dir / sw if self.fabric else self.pin_dir

    def vswitch(self, name: str | None = None) -> "vswitch.VSwitch":
        h = self.switch_named(name)
        uplinks = frozenset(u.leaf_port if u.leaf == h.name else u.spine_port for u in self.uplinks
                            if h.name in (u.leaf, u.spine))
        return vswitch.VSwitch(self.switch_pin_dir(h.name), list(self.port_rates(h.name)), self.mtu, ns=h.ns,
                               routed=uplinks)

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
        raw["uplinks"] = [Uplink(**u) for u in raw.get("uplinks", [])]
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
         delay_ms: float, leaves: int = 0, spines: int = 0, uplink_rate: str | None = None,
         platform: str = platforms.VIRTUAL_DEFAULT, switch_platforms: dict[str, str] | None = None,
         repair_hosts: bool = True) -> RackState:
    """Validate the options and lay out names and addresses (nothing is touched). Every
    switch emulates `platform`, except those `switch_platforms` names (switch -> platform);
    `repair_hosts`: the receive repair on every NIC host (off: a host as it comes)."""
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
    if (leaves == 0) != (spines == 0):
        raise SpecError(f"leaves={leaves}, spines={spines}: a fabric needs both (or neither: one switch)")
    if leaves and not (2 <= leaves <= MAX_LEAVES and 1 <= spines <= MAX_SPINES):
        raise SpecError(f"leaves={leaves}, spines={spines}: use 2..{MAX_LEAVES} leaves and 1..{MAX_SPINES} spines")
    up_bps = 0
    if uplink_rate:
        if not leaves:
            raise SpecError(f"uplink_rate={uplink_rate!r}: only a fabric has uplinks; give leaves and spines")
        try:
            up_bps = parse_rate(uplink_rate)
        except SpecError:
            pass
        if not 1_000_000 <= up_bps <= 100_000_000_000:
            raise SpecError(f"uplink_rate={uplink_rate!r}: use 1mbit..100gbit (e.g. 10mbit)")
    st = RackState(id=rack_id, slot=_free_slot(), rate_bps=bps, mtu=mtu, delay_ms=delay_ms,
                   created=time.time(), leaves=leaves, spines=spines, uplink_rate_bps=up_bps,
                   repair=repair_hosts)
    net = f"198.18.{st.slot}"
    switches = ([f"leaf{k}" for k in range(1, leaves + 1)] + [f"spine{s}" for s in range(1, spines + 1)]
                if leaves else ["sw"])
    for i, name in enumerate(switches):
        st.hosts.append(Host(name, "switch", f"tl{rack_id}-{name}", f"{net}.{2 + i}",
                             f"tl{rack_id}-" + ("m0" if name == "sw" else f"s{i}")))
    names = ([(f"w{i}", "worker") for i in range(1, workers + 1)]
             + [(f"ps{i}", "ps") for i in range(1, ps + 1)]
             + [(f"tr{i}", "traffic") for i in range(1, traffic + 1)])
    on_switch: dict[str, int] = {}
    for i, (name, role) in enumerate(names):
        octet = 10 + i
        h = Host(name, role, f"tl{rack_id}-{name}", f"{net}.{octet}", f"tl{rack_id}-m{i + 1}")
        if leaves:  # the ps on leaf1, workers round-robin, traffic from the last leaf: across the spine
            n = int(name.lstrip("wpstr"))
            k = 1 if role == "ps" else leaves - (n - 1) % leaves if role == "traffic" else (n - 1) % leaves + 1
            h.switch = f"leaf{k}"
            h.data_ipv4, h.data_ipv6 = f"198.19.{k}.{octet}", f"{DATA_V6}{k:x}:{octet:x}"
            h.gateway_ipv4, h.gateway_ipv6 = f"198.19.{k}.1", f"{DATA_V6}{k:x}:1"
        else:
            h.data_ipv4, h.data_ipv6 = f"{DATA_V4}.{octet}", f"{DATA_V6}{octet:x}"
        h.port_index = on_switch.get(h.switch, 0)
        h.port = f"Ethernet{4 * h.port_index}"
        on_switch[h.switch] = h.port_index + 1
        st.hosts.append(h)
    for k in range(1, leaves + 1):
        for sp in range(1, spines + 1):
            j = (k - 1) * spines + sp - 1
            st.uplinks.append(Uplink(f"leaf{k}", f"Ethernet{UPLINK_PORT0 + 4 * (sp - 1)}",
                                     f"{LINK_V4}.{2 * j}", f"{LINK_V6}{2 * j:x}",
                                     f"spine{sp}", f"Ethernet{4 * (k - 1)}",
                                     f"{LINK_V4}.{2 * j + 1}", f"{LINK_V6}{2 * j + 1:x}"))
    platforms.get(platform, "platform")
    st.platforms = {sw: platform for sw in switches}
    for sw, name in (switch_platforms or {}).items():
        if sw not in st.platforms:
            raise SpecError(f"switch_platforms.{sw}: no such switch; the rack's switches are {', '.join(switches)}")
        st.platforms[sw] = platforms.get(name, f"switch_platforms.{sw}").name
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
        "ClientAliveInterval 10", "MaxStartups 64:30:128",
        # bash sources ~/.bashrc before each command sshd starts, unless SHLVL says it is
        # not the top shell. The virtual hosts share this machine's home, whose interactive
        # set-up (pyenv, conda: 0.1-0.5 s of CPU) is no part of a host
        "SetEnv SHLVL=1", "",
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
    # Class 1:1 is the NIC's line rate; everything goes through leaf 1:10 unless a sender
    # shapes its own flow in a class of its own under 1:1 (transport.HtbFlow: the kernel
    # holds a background flow's rate however busy the host is).
    rate = f"{rate_bps}bit"
    _run("tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10", ns=ns)
    for parent, classid in (("1:", "1:1"), ("1:1", "1:10")):
        _run("tc", "class", "replace", "dev", dev, "parent", parent, "classid", classid, "htb", "rate", rate,
             "ceil", rate, "burst", "15k", "cburst", "15k", ns=ns)
    # Deep enough that a sender's socket buffer, not the qdisc, pushes back, as a NIC would.
    _run("tc", "qdisc", "replace", "dev", dev, "parent", "1:10", "handle", "10:", "pfifo",
         "limit", "20000", ns=ns)


def _sysctl(ns: str, *settings: str) -> None:
    for kv in settings:
        _run("sysctl", "-qw", kv, ns=ns)


def _cable_host(st: RackState, h: Host) -> None:
    """A host's data NIC (eth1) to its switch port, under the switch's bridge."""
    sw = st.switch_named(h.switch)
    _run("ip", "link", "add", h.port, "netns", sw.ns, "mtu", str(st.mtu), "type", "veth",
         "peer", "name", "eth1", "netns", h.ns, "mtu", str(st.mtu))
    _run("ip", "link", "set", h.port, "master", "br0", "up", ns=sw.ns)
    v4len, v6len = ("24", "112") if st.fabric else ("24", "64")
    _run("ip", "addr", "add", f"{h.data_ipv4}/{v4len}", "dev", "eth1", ns=h.ns)
    _run("ip", "-6", "addr", "add", f"{h.data_ipv6}/{v6len}", "dev", "eth1", "nodad", ns=h.ns)
    _run("ip", "link", "set", "eth1", "up", ns=h.ns)
    # Real checksums on the data path: a trimmed packet must carry a correct one.
    # Without checksum offload the kernel also drops UDP segmentation offload, so
    # a UDP GSO send is segmented before eth1: the switch sees wire packets only.
    _run("ethtool", "-K", "eth1", "tx", "off", "rx", "off", ns=h.ns)
    _run("ethtool", "-K", h.port, "tx", "off", "rx", "off", ns=sw.ns)
    _host_nic(h.ns, "eth1", st.rate_bps, st.delay_ms)
    if st.repair:
        repair.install("eth1", ns=h.ns)
    if st.fabric:  # the rest of the data network through its leaf
        _run("ip", "route", "add", DATA_NET_V4, "via", h.gateway_ipv4, "dev", "eth1", ns=h.ns)
        _run("ip", "-6", "route", "add", DATA_NET_V6, "via", h.gateway_ipv6, "dev", "eth1", ns=h.ns)


def _cable_uplink(st: RackState, u: Uplink) -> None:
    leaf, spine = st.switch_named(u.leaf), st.switch_named(u.spine)
    _run("ip", "link", "add", u.leaf_port, "netns", leaf.ns, "mtu", str(st.mtu), "type", "veth",
         "peer", "name", u.spine_port, "netns", spine.ns, "mtu", str(st.mtu))
    for ns, port, v4, v6 in ((leaf.ns, u.leaf_port, u.leaf_ipv4, u.leaf_ipv6),
                             (spine.ns, u.spine_port, u.spine_ipv4, u.spine_ipv6)):
        _run("ip", "addr", "add", f"{v4}/31", "dev", port, ns=ns)
        _run("ip", "-6", "addr", "add", f"{v6}/127", "dev", port, "nodad", ns=ns)
        _run("ethtool", "-K", port, "tx", "off", "rx", "off", ns=ns)
        _run("ip", "link", "set", port, "up", ns=ns)


def leaf_prefixes(k: int) -> tuple[str, str]:
    """Leaf k's hosts' prefixes (IPv4, IPv6)."""
    return f"198.19.{k}.0/24", f"{DATA_V6}{k:x}:0/112"


def _routes(st: RackState) -> None:
    """Each leaf: a gateway on its bridge, the other leaves' prefixes over every spine
    (equal cost); each spine: every leaf's prefixes down its link."""
    for k in range(1, st.leaves + 1):
        leaf = st.switch_named(f"leaf{k}")
        _run("ip", "addr", "add", f"198.19.{k}.1/24", "dev", "br0", ns=leaf.ns)
        _run("ip", "-6", "addr", "add", f"{DATA_V6}{k:x}:1/112", "dev", "br0", "nodad", ns=leaf.ns)
        ups = [u for u in st.uplinks if u.leaf == leaf.name]
        for other in range(1, st.leaves + 1):
            if other == k:
                continue
            v4, v6 = leaf_prefixes(other)
            _run("ip", "route", "add", v4, *[a for u in ups for a in ("nexthop", "via", u.spine_ipv4, "dev", u.leaf_port)],
                 ns=leaf.ns)
            _run("ip", "-6", "route", "add", v6,
                 *[a for u in ups for a in ("nexthop", "via", u.spine_ipv6, "dev", u.leaf_port)], ns=leaf.ns)
    for u in st.uplinks:
        spine = st.switch_named(u.spine)
        v4, v6 = leaf_prefixes(int(u.leaf[4:]))
        _run("ip", "route", "add", v4, "via", u.leaf_ipv4, "dev", u.spine_port, ns=spine.ns)
        _run("ip", "-6", "route", "add", v6, "via", u.leaf_ipv6, "dev", u.spine_port, ns=spine.ns)


def _program(st: RackState, sw: Host) -> None:
    """The trimming program on every port of one switch, its own maps, the default config."""
    pin = st.switch_pin_dir(sw.name)
    vswitch.load(pin)
    rates = st.port_rates(sw.name)
    for i, (port, rate) in enumerate(rates.items()):
        vswitch.attach(sw.ns, port, _ifindex(sw.ns, port), i, pin, rate)
    cfg = vswitch.default_config(list(rates), st.rate_bps // 1_000_000, platform=st.platform_of(sw.name))
    cfg.speeds = {p: r // 1_000_000 for p, r in rates.items()}
    st.vswitch(sw.name).write(cfg)


def up(st: RackState, owned: bool = False) -> RackState:
    """Build everything in `st`; on any failure, take down what was built. `owned`: this
    process takes it down when done, so once the process is gone the rack is stale."""
    st.owner = rundir.owner() if owned else None
    st.save()  # first, so that `down` finds a half-built rack
    rundir.on_overdue_stop(f"rack {st.id}", lambda: down(st))
    try:
        _keys(st)
        _run("ip", "link", "add", st.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"198.18.{st.slot}.1/24", "dev", st.bridge)
        _run("ip", "link", "set", st.bridge, "up")
        for h in st.hosts:
            _run("ip", "netns", "add", h.ns)
            _run("ip", "link", "set", "lo", "up", ns=h.ns)
            _run("ip", "link", "add", h.mgmt_link, "type", "veth", "peer", "name", "eth0", "netns", h.ns)
            _run("ip", "link", "set", h.mgmt_link, "master", st.bridge, "up")
            _run("ip", "addr", "add", f"{h.mgmt_ip}/24", "dev", "eth0", ns=h.ns)
            _run("ip", "link", "set", "eth0", "up", ns=h.ns)
        for sw in st.switches:
            if st.fabric:  # a router: forwarding, multipath by the L4 hash (5-tuple)
                _sysctl(sw.ns, "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1",
                        "net.ipv4.fib_multipath_hash_policy=1", "net.ipv6.fib_multipath_hash_policy=1",
                        "net.ipv4.conf.all.rp_filter=0", "net.ipv4.conf.default.rp_filter=0")
            _run("ip", "link", "add", "br0", "type", "bridge", ns=sw.ns)
            _run("ip", "link", "set", "br0", "up", ns=sw.ns)
        for h in st.nic_hosts:
            _cable_host(st, h)
        for u in st.uplinks:
            _cable_uplink(st, u)
        if st.fabric:
            _routes(st)
        for sw in st.switches:
            _program(st, sw)
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
    if not owned:  # left up on purpose: a later stop signal is not this rack's
        rundir.on_overdue_stop(f"rack {st.id}", None)
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


def _inventory_ports(st: RackState, sw: Host) -> dict[str, dict]:
    """A switch's ports as lab.example.yml has them: host-facing ones name their host,
    network-facing ones (uplinks) their peer switch and port."""
    rates = st.port_rates(sw.name)
    ns = {h.name: h.ns for h in st.hosts}
    out = {h.port: {"host": h.ns, "facing": "host"} for h in st.nic_hosts if h.switch == sw.name}
    for u in st.uplinks:
        if u.leaf == sw.name:
            out[u.leaf_port] = {"facing": "network", "peer": f"{ns[u.spine]}:{u.spine_port}"}
        elif u.spine == sw.name:
            out[u.spine_port] = {"facing": "network", "peer": f"{ns[u.leaf]}:{u.leaf_port}"}
    return {p: d | {"speed_mbps": rates[p] // 1_000_000} for p, d in out.items()}


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
            "trim_switches": {"hosts": {sw.ns: {
                "ansible_host": sw.mgmt_ip,
                "trim_switch_os": "vswitch",
                "trim_switch_platform": st.platform_of(sw.name),
                "trimlab_switch": sw.name,  # which switch of the rack `trimlab switch` drives
                "ports": _inventory_ports(st, sw),
            } for sw in st.switches}},
            "nic_hosts": {"hosts": {h.ns: {
                "ansible_host": h.mgmt_ip, "role": h.role, "data_if": "eth1",
                "data_ipv4": h.data_ipv4, "data_ipv6": h.data_ipv6, "switch_port": h.port,
                "nic_host_repair": st.repair,
            } for h in st.nic_hosts}},
        },
    }}
    path = st.inventory
    path.write_text(f"# trimlab virtual rack {st.id}: written by `trimlab rack up`\n"
                    + yaml.safe_dump(inv, sort_keys=False))
    return path


# -- status and tear-down --------------------------------------------------------------------

def _program_attached(st: RackState, sw: Host, nss: set[str]) -> bool:
    """The trimming program on every port of the switch."""
    if sw.ns not in nss:
        return False
    return all("trimlab_egress" in _run("tc", "filter", "show", "dev", p, "egress", ns=sw.ns, check=False).stdout
               for p in st.port_rates(sw.name))


def status(st: RackState) -> dict:
    nss = set(_netns_list())
    programs = {sw.name: _program_attached(st, sw, nss) for sw in st.switches}
    return {
        "id": st.id, "inventory": str(st.inventory), "mgmt": f"198.18.{st.slot}.0/24",
        "rate_bps": st.rate_bps, "mtu": st.mtu, "delay_ms": st.delay_ms,
        "switch_program": all(programs.values()), "switch_programs": programs,
        "fabric": {"leaves": st.leaves, "spines": st.spines,
                   "uplink_rate_bps": st.uplink_rate_bps or st.rate_bps} if st.fabric else None,
        "uplinks": [asdict(u) for u in st.uplinks],
        "hosts": [{"name": h.name, "role": h.role, "ns": h.ns, "mgmt_ip": h.mgmt_ip,
                   "data_ipv4": h.data_ipv4, "data_ipv6": h.data_ipv6, "port": h.port,
                   "switch": h.switch if h.role != "switch" else "", "namespace": h.ns in nss, "sshd": sshd_banner(h.mgmt_ip).startswith("SSH-")}
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
    rundir.on_overdue_stop(f"rack {st.id}", None)
    _kill_pidfiles(st.dir / "run")
    _remove(f"tl{st.id}-")
    vswitch.unpin(st.pin_dir)
    # the hosts' run files (on this machine): what a run killed outright could not collect
    for host_dir in Path(REMOTE_ROOT).glob(f"*/tl{st.id}-*"):
        shutil.rmtree(host_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            host_dir.parent.rmdir()  # the run's folder, once no rack's host is left in it
    if st.dir.exists():
        shutil.rmtree(st.dir, ignore_errors=True)


def stale() -> dict[str, str]:
    """Racks whose owner is gone (killed, crashed, rebooted) and tl* namespaces that no
    rack's state file names: rack id -> why. Racks whose owner lives, and racks left up
    on purpose, are not in it."""
    out = {}
    ids = list_ids()
    for rid in ids:
        try:
            st = RackState.load(rid)
        except (RackError, ValueError, TypeError, KeyError):
            out[rid] = "its state file cannot be read"
            continue
        if st.owner and not rundir.owner_alive(st.owner):
            out[rid] = f"its owner, process {st.owner.get('pid')}, is gone"
    for ns in _netns_list():
        m = re.match(r"tl([a-z0-9]{1,6})-", ns)
        if m and m.group(1) not in ids:
            out.setdefault(m.group(1), "namespaces with no rack state (a rack killed while it was built or taken down)")
    return out


def reclaim() -> dict[str, str]:
    """Take down every stale rack (see stale()), nothing else; returns what it removed."""
    found = stale()
    for rid in found:
        try:
            down(RackState.load(rid))
        except (RackError, ValueError, TypeError, KeyError):
            _kill_pidfiles(racks_dir() / rid / "run")
            _remove(f"tl{rid}-")
            vswitch.unpin(BPF_ROOT / f"tl{rid}")
            shutil.rmtree(racks_dir() / rid, ignore_errors=True)
    return found


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
