"""The eBPF trimming switch: build, attach, configure and read it.

The program (trim.c) is compiled with clang at rack up, cached by source hash, loaded
once per rack with bpftool and its maps pinned under /sys/fs/bpf/tl<id>/; every switch
port attaches the same pinned program on clsact egress, under an HTB (port rate) →
prio (8 strict-priority bands) qdisc tree.

Configuration arrives as the SONiC Config DB fragment (SWITCH_TRIMMING|GLOBAL,
BUFFER_PROFILE, BUFFER_QUEUE, DSCP_TO_TC_MAP, TC_TO_QUEUE_MAP, PORT speed), the same
thing the SONiC target renders, plus TRIMLAB_INJECT|GLOBAL for deterministic injection.
It is validated whole before any map is written.
"""

from __future__ import annotations

import copy
import csv
import json
import os
import shutil
import struct
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from trimlab import native, resources, rundir
from trimlab.errors import SpecError, TrimlabError
from trimlab import platforms
from trimlab.testbed.targets.vswitch import MIN_TRIM_SIZE, NQ
from trimlab.testbed.vrack.bpfmap import PinnedMap

SOURCE = resources.c_source("testbed.vrack.vswitch", "trim.c")
MAX_PORTS = 64
MAX_IFINDEX = 4096  # trim.c: port_of is an array indexed by ifindex
ACTIONS = {"drop": 0, "trim": 1}
COUNTERS = ("TX_PKTS", "TX_BYTES", "TRIM_PKTS", "TRIM_TX_PKTS", "TRIM_DRP_PKTS", "DROP_PKTS")
_QSTATE = struct.Struct("<IIQQQQQQQQQ")  # lock, pad, occ, last_ns, peak, then COUNTERS order below
_GCFG = struct.Struct("<12IQ")  # ... from_tc, flags, platform (catalog index), inject queues, pad, trimmed DSCPs
_PORTCFG = struct.Struct("<Q8I8BBB6x")  # rate, budgets, actions, trimmed-packet DSCP, routed
_U32 = struct.Struct("<I")


class SwitchError(TrimlabError):
    """The virtual switch cannot be built or reached."""


class ProgramDetached(SwitchError):
    """The trimming program left a port while the switch was in use."""


def build() -> Path:
    """Compile trim.c (once per source and flags: cached by their hash)."""
    try:
        return native.build(SOURCE, "clang", native.bpf_cflags() + ["-Wall", "-c"], "vswitch", ".o",
                            headers=(native.BPF_CSUM_H,))
    except native.BuildError as exc:
        raise SwitchError(f"{exc} (clang, llvm and libbpf-dev are needed)") from None


def _sh(*cmd: str, ns: str | None = None) -> subprocess.CompletedProcess:
    # nsenter, not `ip netns exec`: the latter remounts /sys and hides /sys/fs/bpf pins.
    full = (["nsenter", f"--net=/run/netns/{ns}"] if ns else []) + list(cmd)
    with rundir.stop_deferred():  # a pin or filter half made by a stop would outlive the rack's removal
        out = subprocess.run(full, capture_output=True, text=True)
    if out.returncode:
        raise SwitchError(f"`{' '.join(full)}` failed: {out.stderr.strip()}")
    return out


def load(pin_dir: Path) -> None:
    """Load the program and pin it with its maps in `pin_dir` (under bpffs)."""
    obj = build()
    if not os.path.ismount("/sys/fs/bpf"):
        _sh("mount", "-t", "bpf", "bpf", "/sys/fs/bpf")
    pin_dir.mkdir(parents=True, exist_ok=True)
    _sh("bpftool", "prog", "load", str(obj), str(pin_dir / "prog"), "type", "classifier",
        "pinmaps", str(pin_dir))


def unpin(pin_dir: Path) -> None:
    if pin_dir.exists():
        shutil.rmtree(pin_dir, ignore_errors=True)


def attach(ns: str, ifname: str, ifindex: int, port: int, pin_dir: Path, rate_bps: int) -> None:
    """Scheduling tree and the egress program on one switch port. Strict priority under a
    rate limiter, with HTB alone (the kernels we meet may lack sch_prio): eight leaf
    classes with a token assured rate borrow the port rate in `prio` order, band 0 first.
    The program classifies by setting skb->priority to 1:(10 + band)."""
    set_port_rate(ns, ifname, rate_bps, create=True)
    for band in range(NQ):
        _sh("tc", "class", "replace", "dev", ifname, "parent", "1:1", "classid", f"1:{0x10 + band:x}",
            "htb", "rate", "8kbit", "ceil", f"{rate_bps}bit", "prio", str(band), "quantum", "1514", ns=ns)
        _sh("tc", "qdisc", "replace", "dev", ifname, "parent", f"1:{0x10 + band:x}", "handle",
            f"{0x10 + band:x}:", "pfifo", "limit", "10000", ns=ns)
    _sh("tc", "qdisc", "replace", "dev", ifname, "clsact", ns=ns)
    attach_program(ns, ifname, pin_dir)
    if ifindex >= MAX_IFINDEX:
        raise SwitchError(f"switch port {ifname} has ifindex {ifindex}; the program maps at most {MAX_IFINDEX}")
    with PinnedMap(str(pin_dir / "port_of"), 4) as m:
        m.update(ifindex, _U32.pack(port + 1))  # 0 means: not a switch port


def attach_program(ns: str, ifname: str, pin_dir: Path) -> None:
    _sh("tc", "filter", "replace", "dev", ifname, "egress", "pref", "1", "handle", "1", "bpf",
        "direct-action", "object-pinned", str(pin_dir / "prog"), ns=ns)


def set_port_rate(ns: str, ifname: str, rate_bps: int, create: bool = False) -> None:
    """The HTB root (default: the lowest band) and its port-rate class."""
    rate = f"{rate_bps}bit"
    if create:
        _sh("tc", "qdisc", "replace", "dev", ifname, "root", "handle", "1:", "htb",
            "default", f"{0x10 + NQ - 1:x}", ns=ns)
    _sh("tc", "class", "replace", "dev", ifname, "parent", "1:", "classid", "1:1", "htb",
        "rate", rate, "ceil", rate, "burst", "15k", "cburst", "15k", ns=ns)


@dataclass
class SwitchConfig:
    """The running configuration, in the switch's terms (validated)."""

    size: int = 128
    dscp_value: int = 48
    queue_index: int = 7
    tc_value: int | None = None  # from-tc: the trim TC, whose DSCP each port's map gives
    trim_dscp: dict[str, int] = field(default_factory=dict)  # from-tc: port -> DSCP of its trimmed packets
    dscp_to_queue: list[int] = field(default_factory=lambda: [d >> 3 for d in range(64)])
    budgets: dict[str, list[int]] = field(default_factory=dict)  # port -> bytes per queue
    actions: dict[str, list[str]] = field(default_factory=dict)  # port -> action per queue
    speeds: dict[str, int] = field(default_factory=dict)  # port -> Mb/s
    inject_probability: float = 0.0
    inject_action: str = "trim"
    inject_seed: int = 0
    inject_queues: list[int] = field(default_factory=list)  # the queues injection reaches ([]: the trimming ones)
    platform: str = platforms.VIRTUAL_DEFAULT  # the switch model it emulates (fixed at rack up)

    def port_trim_dscp(self, port: str) -> int:
        return self.trim_dscp[port] if self.tc_value is not None else self.dscp_value

    def to_config_db(self) -> dict:
        """The SONiC Config DB fragment that means this configuration."""
        profiles, queues = {}, {}
        for port, budget in self.budgets.items():
            for q in range(NQ):
                name = f"q_{self.actions[port][q]}_{budget[q]}"
                profiles[name] = {"pool": "egress_lossy_pool", "size": "0",
                                  "static_th": str(budget[q]),
                                  "packet_discard_action": self.actions[port][q]}
                queues[f"{port}|{q}"] = {"profile": name}
        glob = {"size": str(self.size), "dscp_value": str(self.dscp_value), "queue_index": str(self.queue_index)}
        from_tc = {}
        if self.tc_value is not None:  # one TC_TO_DSCP map per distinct DSCP, named by it
            glob = {"size": str(self.size), "dscp_value": "from-tc", "tc_value": str(self.tc_value),
                    "queue_index": str(self.queue_index)}
            from_tc = {"TC_TO_DSCP_MAP": {f"trimlab_trim_dscp_{d}": {str(self.tc_value): str(d)}
                                          for d in sorted(set(self.trim_dscp.values()))},
                       "PORT_QOS_MAP": {p: {"tc_to_dscp_map": f"trimlab_trim_dscp_{d}"}
                                        for p, d in self.trim_dscp.items()}}
        return {
            "SWITCH_TRIMMING": {"GLOBAL": glob},
            **from_tc,
            "DSCP_TO_TC_MAP": {"TRIMLAB": {str(d): str(q) for d, q in enumerate(self.dscp_to_queue)}},
            "TC_TO_QUEUE_MAP": {"TRIMLAB": {str(q): str(q) for q in range(NQ)}},
            "BUFFER_PROFILE": profiles,
            "BUFFER_QUEUE": queues,
            "PORT": {p: {"speed": str(s)} for p, s in self.speeds.items()},
            "TRIMLAB_INJECT": {"GLOBAL": {"probability": str(self.inject_probability),
                                          "action": self.inject_action, "seed": str(self.inject_seed),
                                          "queues": ",".join(map(str, self.inject_queues))}},
            "TRIMLAB_PLATFORM": {"GLOBAL": {"name": self.platform}},
        }

    def trimmed_dscps(self) -> int:
        """Bit d set: DSCP d marks a trimmed packet on some port (trim-once platforms)."""
        ds = set(self.trim_dscp.values()) if self.tc_value is not None else {self.dscp_value}
        return sum(1 << d for d in ds)


def _flat(cfg: SwitchConfig) -> dict[str, str]:
    out = {}
    for table, keys in cfg.to_config_db().items():
        for key, fields in keys.items():
            for f, v in fields.items():
                out[f"{table}|{key}.{f}"] = v
    return out


def config_diff(old: SwitchConfig, new: SwitchConfig) -> dict[str, list]:
    a, b = _flat(old), _flat(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def _int(value, where: str, lo: int, hi: int) -> int:
    try:
        v = int(str(value), 0)
    except ValueError:
        raise SpecError(f"{where}: {value!r} is not an integer") from None
    if not lo <= v <= hi:
        raise SpecError(f"{where}: {v} is out of range ({lo}..{hi})")
    return v


def _queue_list(spec: str, where: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        a, b = _int(lo, where, 0, NQ - 1), _int(hi or lo, where, 0, NQ - 1)
        out.extend(range(a, b + 1))
    return out


def _from_tc(doc: dict, g: dict, ports: list[str], cfg: SwitchConfig) -> None:
    """dscp_value from-tc: each port's trimmed packets take the DSCP its PORT_QOS_MAP's
    tc_to_dscp_map gives the trim TC (tc_value): asymmetric profiles, per facing."""
    if "tc_value" not in g:
        raise SpecError("SWITCH_TRIMMING|GLOBAL.tc_value: from-tc needs the trim TC (0..7)")
    tc = _int(g["tc_value"], "SWITCH_TRIMMING|GLOBAL.tc_value", 0, NQ - 1)
    maps, qos = doc.get("TC_TO_DSCP_MAP", {}), doc.get("PORT_QOS_MAP", {})
    dscp = {}
    for port in ports:
        name = qos.get(port, {}).get("tc_to_dscp_map")
        if name is None:
            raise SpecError(f"PORT_QOS_MAP|{port}.tc_to_dscp_map: from-tc needs a TC_TO_DSCP map on every port")
        if name not in maps or str(tc) not in maps[name]:
            raise SpecError(f"TC_TO_DSCP_MAP|{name}: no DSCP for the trim TC {tc} (PORT_QOS_MAP|{port})")
        dscp[port] = _int(maps[name][str(tc)], f"TC_TO_DSCP_MAP|{name}.{tc}", 0, 63)
    cfg.tc_value, cfg.trim_dscp = tc, dscp


def parse_config_db(doc: dict, ports: list[str], current: SwitchConfig, mtu: int) -> SwitchConfig:
    """Merge a Config DB fragment into `current`; every error names the table and key."""
    cfg = copy.deepcopy(current)
    known = {"SWITCH_TRIMMING", "BUFFER_PROFILE", "BUFFER_QUEUE", "DSCP_TO_TC_MAP",
             "TC_TO_QUEUE_MAP", "TC_TO_DSCP_MAP", "PORT_QOS_MAP", "PORT", "TRIMLAB_INJECT", "BUFFER_POOL",
             "TRIMLAB_PLATFORM"}
    for table in doc:
        if table not in known:
            raise SpecError(f"{table}: unknown table; the virtual switch reads {', '.join(sorted(known))}")
    want = doc.get("TRIMLAB_PLATFORM", {}).get("GLOBAL", {}).get("name", cfg.platform)
    if want != cfg.platform:
        raise SpecError(f"TRIMLAB_PLATFORM|GLOBAL.name: {want!r}, but this switch emulates {cfg.platform} "
                        "(its hardware: chosen at rack up, `trimlab rack up --platform`); fix "
                        "trim_switch_platform in the inventory")
    plat = platforms.get(cfg.platform)
    g = doc.get("SWITCH_TRIMMING", {}).get("GLOBAL", {})
    if "size" in g:
        cfg.size = _int(g["size"], "SWITCH_TRIMMING|GLOBAL.size", MIN_TRIM_SIZE, mtu + 14)
    if "dscp_value" in g:
        if str(g["dscp_value"]) == "from-tc":
            _from_tc(doc, g, ports, cfg)
        else:
            cfg.dscp_value = _int(g["dscp_value"], "SWITCH_TRIMMING|GLOBAL.dscp_value", 0, 63)
            cfg.tc_value, cfg.trim_dscp = None, {}
    if "queue_index" in g:
        if str(g["queue_index"]) == "dynamic":
            raise SpecError("SWITCH_TRIMMING|GLOBAL.queue_index: dynamic is not supported by the "
                            "virtual switch; give a queue 0..7")
        cfg.queue_index = _int(g["queue_index"], "SWITCH_TRIMMING|GLOBAL.queue_index", 0, NQ - 1)
    if not plat.trim_size.allows(cfg.size):
        raise SpecError(f"SWITCH_TRIMMING|GLOBAL.size: {cfg.size}; platform {plat.name} trims to "
                        f"{plat.trim_size.text()}")
    if cfg.queue_index not in plat.trim_queues:
        raise SpecError(f"SWITCH_TRIMMING|GLOBAL.queue_index: {cfg.queue_index}; platform {plat.name} sends "
                        f"trimmed packets on queues {', '.join(map(str, plat.trim_queues))}")
    dscp_maps = doc.get("DSCP_TO_TC_MAP", {})
    tc_maps = doc.get("TC_TO_QUEUE_MAP", {})
    if len(dscp_maps) > 1 or len(tc_maps) > 1:
        raise SpecError("DSCP_TO_TC_MAP/TC_TO_QUEUE_MAP: the virtual switch applies one map to "
                        "every port; give one of each")
    if dscp_maps or tc_maps:
        (dname, dmap), = dscp_maps.items() if dscp_maps else (("identity", {str(d): str(d >> 3) for d in range(64)}),)
        (tname, tmap), = tc_maps.items() if tc_maps else (("identity", {str(t): str(t) for t in range(NQ)}),)
        tc_of = [0] * 64
        for d, tc in dmap.items():
            tc_of[_int(d, f"DSCP_TO_TC_MAP|{dname}", 0, 63)] = _int(tc, f"DSCP_TO_TC_MAP|{dname}.{d}", 0, NQ - 1)
        queue_of_tc = list(range(NQ))
        for t, q in tmap.items():
            queue_of_tc[_int(t, f"TC_TO_QUEUE_MAP|{tname}", 0, NQ - 1)] = _int(q, f"TC_TO_QUEUE_MAP|{tname}.{t}", 0, NQ - 1)
        cfg.dscp_to_queue = [queue_of_tc[tc_of[d]] for d in range(64)]
    profiles = doc.get("BUFFER_PROFILE", {})
    for name, prof in profiles.items():
        action = prof.get("packet_discard_action", "drop")
        if action not in ACTIONS:
            raise SpecError(f"BUFFER_PROFILE|{name}.packet_discard_action: {action!r}; use trim or drop")
        if "static_th" not in prof and "size" not in prof:
            raise SpecError(f"BUFFER_PROFILE|{name}: give static_th (the queue's byte budget)")
    for key, binding in doc.get("BUFFER_QUEUE", {}).items():
        port_part, sep, qpart = key.partition("|")
        if not sep:
            raise SpecError(f"BUFFER_QUEUE|{key}: key must be PORT|QUEUES, e.g. Ethernet0|3-4")
        name = binding.get("profile", "")
        if name not in profiles:
            raise SpecError(f"BUFFER_QUEUE|{key}.profile: {name!r} is not in BUFFER_PROFILE")
        prof = profiles[name]
        budget = _int(prof.get("static_th", prof.get("size")), f"BUFFER_PROFILE|{name}.static_th", 0, 1 << 31)
        for port in port_part.split(","):
            if port not in ports:
                raise SpecError(f"BUFFER_QUEUE|{key}: port {port} does not exist; ports are {', '.join(ports)}")
            for q in _queue_list(qpart, f"BUFFER_QUEUE|{key}"):
                cfg.budgets[port][q] = budget
                cfg.actions[port][q] = prof.get("packet_discard_action", "drop")
    for port, attrs in doc.get("PORT", {}).items():
        if port not in ports:
            raise SpecError(f"PORT|{port}: port does not exist; ports are {', '.join(ports)}")
        if "speed" in attrs:
            cfg.speeds[port] = _int(attrs["speed"], f"PORT|{port}.speed", 1, 400_000)
    inj = doc.get("TRIMLAB_INJECT", {}).get("GLOBAL", {})
    if "probability" in inj:
        try:
            p = float(inj["probability"])
        except ValueError:
            p = -1.0
        if not 0.0 <= p <= 1.0:
            raise SpecError(f"TRIMLAB_INJECT|GLOBAL.probability: {inj['probability']!r}; use 0..1")
        cfg.inject_probability = p
    if "action" in inj:
        if inj["action"] not in ACTIONS:
            raise SpecError(f"TRIMLAB_INJECT|GLOBAL.action: {inj['action']!r}; use trim or drop")
        cfg.inject_action = inj["action"]
    if "seed" in inj:
        cfg.inject_seed = _int(inj["seed"], "TRIMLAB_INJECT|GLOBAL.seed", 0, (1 << 32) - 1)
    if "queues" in inj:  # "": the trimming queues
        q = str(inj["queues"])
        cfg.inject_queues = sorted(set(_queue_list(q, "TRIMLAB_INJECT|GLOBAL.queues"))) if q else []
    return cfg


class VSwitch:
    """A running virtual switch: its pinned maps and its ports (name -> index)."""

    def __init__(self, pin_dir: Path, ports: list[str], mtu: int, ns: str | None = None,
                 routed: frozenset[str] = frozenset()):
        self.pin_dir, self.ports, self.mtu, self.ns = pin_dir, ports, mtu, ns
        self.routed = routed  # ports whose next hop is a Linux router (fabric uplinks)

    def _map(self, name: str, size: int, spin_lock: bool = False) -> PinnedMap:
        path = self.pin_dir / name
        if not path.exists():
            raise SwitchError(f"switch map {path} is missing: is the rack up? (trimlab rack status)")
        return PinnedMap(str(path), size, spin_lock)

    def write(self, cfg: SwitchConfig) -> None:
        """Write a validated configuration into the maps; counters are not touched."""
        with self._map("ports", _PORTCFG.size) as m:
            for i, port in enumerate(self.ports):
                rate = cfg.speeds[port] * 1_000_000 // 8
                acts = [ACTIONS[a] for a in cfg.actions[port]]
                m.update(i, _PORTCFG.pack(rate, *cfg.budgets[port], *acts, cfg.port_trim_dscp(port),
                                          port in self.routed))
        with self._map("dscp_queue", 4) as m:
            for d, q in enumerate(cfg.dscp_to_queue):
                m.update(d, _U32.pack(q))
        p32 = min(int(cfg.inject_probability * (1 << 32)), (1 << 32) - 1)
        plat = platforms.get(cfg.platform)
        with self._map("config", _GCFG.size) as m:
            m.update(0, _GCFG.pack(1, cfg.size, cfg.dscp_value, cfg.queue_index, p32,
                                   ACTIONS[cfg.inject_action], cfg.inject_seed,
                                   0 if cfg.tc_value is None else cfg.tc_value + 1,  # gcfg.from_tc
                                   plat.flags, list(platforms.catalog()).index(plat.name),
                                   sum(1 << q for q in cfg.inject_queues), 0, cfg.trimmed_dscps()))

    def read(self) -> SwitchConfig:
        with self._map("config", _GCFG.size) as m:
            enabled, size, dscp, qidx, p32, inj_act, seed, tc1, _, plat, inj_q, _, _ = _GCFG.unpack(m.lookup(0))
        names = {v: k for k, v in ACTIONS.items()}
        cfg = SwitchConfig(size=size, dscp_value=dscp, queue_index=qidx, tc_value=tc1 - 1 if tc1 else None,
                           inject_probability=p32 / (1 << 32), inject_action=names[inj_act],
                           inject_seed=seed, inject_queues=[q for q in range(NQ) if inj_q >> q & 1],
                           platform=list(platforms.catalog())[plat])
        with self._map("dscp_queue", 4) as m:
            cfg.dscp_to_queue = [_U32.unpack(m.lookup(d))[0] for d in range(64)]
        with self._map("ports", _PORTCFG.size) as m:
            for i, port in enumerate(self.ports):
                rate, *rest = _PORTCFG.unpack(m.lookup(i))
                cfg.speeds[port] = rate * 8 // 1_000_000
                cfg.budgets[port] = list(rest[:NQ])
                cfg.actions[port] = [names[a] for a in rest[NQ:2 * NQ]]
                if cfg.tc_value is not None:
                    cfg.trim_dscp[port] = rest[2 * NQ]
                # rest[2 * NQ + 1], routed, is the rack's wiring, not configuration
        return cfg

    def plan(self, doc: dict) -> tuple[SwitchConfig, SwitchConfig, dict]:
        """(running, wanted, diff) for a Config DB fragment; nothing is written. The diff
        maps each changed 'TABLE|KEY.field' to [running, wanted]."""
        old = self.read()
        new = parse_config_db(doc, self.ports, old, self.mtu)
        return old, new, config_diff(old, new)

    def apply(self, doc: dict) -> SwitchConfig:
        """Validate a Config DB fragment against the running config, then write it (and
        the port rate limiters whose speed changed)."""
        old, cfg, _ = self.plan(doc)
        for port in self.ports:
            if self.ns and cfg.speeds[port] != old.speeds[port]:
                set_port_rate(self.ns, port, cfg.speeds[port] * 1_000_000)
        self.write(cfg)
        return cfg

    def detached_ports(self) -> list[str]:
        """The ports whose tc egress no longer runs this switch's program."""
        prog = json.loads(_sh("bpftool", "-j", "prog", "show", "pinned", str(self.pin_dir / "prog")).stdout)["id"]
        nets = json.loads(_sh("bpftool", "-j", "net", "show", ns=self.ns).stdout)
        on = {e["devname"] for d in nets for e in d.get("tc", [])
              if e.get("kind") == "clsact/egress" and e.get("id") == prog}
        return [p for p in self.ports if p not in on]

    def queue_counters(self) -> dict[str, list[dict[str, int]]]:
        """Per port, per queue: SONiC-named counters plus occupancy and its peak (bytes)."""
        out = {}
        with self._map("ports", _PORTCFG.size) as m:
            rates = [_PORTCFG.unpack(m.lookup(i))[0] for i in range(len(self.ports))]
        with self._map("queues", _QSTATE.size, spin_lock=True) as m:
            now = time.monotonic_ns()  # the program's clock (bpf_ktime_get_ns)
            for i, port in enumerate(self.ports):
                rows = []
                for q in range(NQ):
                    _, _, occ, last, peak, tx, txb, trim, trim_tx, trim_drp, drop = _QSTATE.unpack(
                        m.lookup(i * NQ + q))
                    rows.append({"TX_PKTS": tx, "TX_BYTES": txb, "TRIM_PKTS": trim,
                                 "TRIM_TX_PKTS": trim_tx, "TRIM_DRP_PKTS": trim_drp, "DROP_PKTS": drop,
                                 "OCCUPANCY": drained(occ, now - last, rates[i]), "PEAK_OCCUPANCY": peak})
                out[port] = rows
        return out

    def rx_counters(self) -> dict[str, dict[str, int]]:
        """Per port, what it received from its host (RX_PKTS, RX_BYTES: frames, Ethernet
        header included, as SONiC's port counters count them): the kernel's own counters of
        the port's interface, independent of the program."""
        links = json.loads(_sh("ip", "-j", "-s", "link", "show", ns=self.ns).stdout)
        stats = {ln["ifname"]: ln.get("stats64", ln.get("stats", {})).get("rx", {}) for ln in links}
        return {p: {"RX_PKTS": int(stats.get(p, {}).get("packets", 0)), "RX_BYTES": int(stats.get(p, {}).get("bytes", 0))}
                for p in self.ports}

    def counters(self) -> dict:
        """Switch, port and queue level counters (sums of the queue counters; the ports'
        received counters from their interfaces)."""
        queues = self.queue_counters()
        rx = self.rx_counters()
        ports = {p: {c: sum(r[c] for r in rows) for c in COUNTERS}
                 | {"PEAK_OCCUPANCY": max(r["PEAK_OCCUPANCY"] for r in rows)} | rx[p] for p, rows in queues.items()}
        switch = {c: sum(p[c] for p in ports.values()) for c in COUNTERS}
        return {"switch": switch, "ports": ports, "queues": queues}


SAMPLE_COLUMNS = ("time_s", "port", "queue", "OCCUPANCY", "PEAK_OCCUPANCY", *COUNTERS)


def drained(occ: int, elapsed_ns: int, rate: int) -> int:
    """A virtual queue's occupancy `elapsed_ns` after its last update: the program drains
    it only when a packet arrives, so a reader drains it to now the same way (admit())."""
    if elapsed_ns > 1_000_000_000:
        return 0
    return max(0, occ - max(0, elapsed_ns) * rate // 1_000_000_000)


def sample(sw: VSwitch, out: Path, interval: float = 0.01, duration: float | None = None,
           stop=None, watch_s: float = 1.0) -> int:
    """Record occupancy and counters of every (port, queue) every `interval` seconds into
    a CSV until `duration` passes, `stop` (a threading.Event-like) is set or the rack goes
    down. Rows are flushed as they are written, so a killed sampler keeps what it saw.
    Every `watch_s` it checks that the program is still on every port: ProgramDetached
    otherwise (a run that goes on would measure a switch that no longer trims). Returns
    the number of samples."""
    t0 = time.time()
    n = 0
    with open(out, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SAMPLE_COLUMNS)
        next_at = time.monotonic()
        while not (stop is not None and stop.is_set()):
            now = time.time()
            if duration is not None and now - t0 >= duration:
                break
            try:
                counters = sw.queue_counters()
            except (SwitchError, OSError):  # the rack went down: its pins are gone
                break
            for port, rows in counters.items():
                for q, r in enumerate(rows):
                    w.writerow([f"{now:.6f}", port, q, r["OCCUPANCY"], r["PEAK_OCCUPANCY"],
                                *(r[c] for c in COUNTERS)])
            f.flush()
            n += 1
            if sw.ns and n % max(1, round(watch_s / interval)) == 0:
                try:
                    gone = sw.detached_ports()
                except SwitchError:  # the rack went down: its pins are gone
                    break
                if gone:
                    raise ProgramDetached(f"the trimming program is no longer attached to {', '.join(gone)} "
                                          "(its tc egress filter is gone): the switch forwards without trimming "
                                          "or counting")
            next_at += interval
            time.sleep(max(0.0, next_at - time.monotonic()))
    return n


def default_config(ports: list[str], speed_mbps: int, budget: int = 64 * 1024,
                   trim_queues: tuple[int, ...] = (1,), platform: str = platforms.VIRTUAL_DEFAULT) -> SwitchConfig:
    """A switch that trims queue 1 (DSCP 8–15, AF1x) and drops elsewhere, SONiC's default
    128-byte trim size (a fixed-size platform's own), trimmed packets remarked DSCP 48 and
    sent on queue 7, emulating `platform`."""
    plat = platforms.get(platform)
    cfg = SwitchConfig(platform=platform, size=plat.trim_size.fixed or max(128, plat.trim_size.min))
    for p in ports:
        cfg.budgets[p] = [budget] * NQ
        cfg.actions[p] = ["trim" if q in trim_queues else "drop" for q in range(NQ)]
        cfg.speeds[p] = speed_mbps
    return cfg


def load_config_file(path: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such file") from None
    except json.JSONDecodeError as exc:
        raise SpecError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
