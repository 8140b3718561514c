"""`trimlab run`: an experiment (or every point of its sweep) from spec to run directory.

    spec validated → rack (virtual: brought up here; or a lab inventory) → provision with the
    run's profile → counters, sampler, captures, traffic → workers and ps over SSH, with
    progress → everything stopped → artifacts collected over SFTP → manifest → report.

A failed or interrupted run stops every agent, keeps what was collected, says why in its
manifest, takes the virtual rack down, and exits 1.
"""

from __future__ import annotations

import json
import secrets
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from testbed import inventory as inv
from testbed import remote
from testbed.errors import SpecError, TrimlabError
from testbed.rundir import RunDir
from testbed.spec import ExperimentSpec, load_experiment, load_profile

REMOTE_ROOT = "/var/tmp/trimlab"
TRAFFIC_PORT = 48000
DDP_PORT = 29500  # torch.distributed's rendezvous at rank 0, on the management network
EXAMPLE_DDP_SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "ddp_train.py"


def ddp_script(spec: ExperimentSpec) -> str:
    return spec.workload.script or str(EXAMPLE_DDP_SCRIPT)


class RunFailed(TrimlabError):
    """The run started but did not complete: the manifest says why."""

    exit_code = 1


# -- placement: which host runs what ------------------------------------------------------------

@dataclass
class Placement:
    rack: inv.Rack
    switch: inv.SwitchEntry
    workers: list[inv.HostEntry]
    ps: inv.HostEntry | None
    traffic: list[inv.HostEntry]
    hosts: dict[str, remote.Host] = field(default_factory=dict)

    def addr(self, h: inv.HostEntry, ipv6: bool) -> str:
        return h.vars["data_ipv6" if ipv6 else "data_ipv4"]

    @property
    def sink(self) -> inv.HostEntry:
        """Where background flows go: the ps's port (the incast's), else the first worker's."""
        return self.ps or self.workers[0]

    def python(self, name: str) -> str:
        v = self.rack.vars | self._vars(name)
        return v.get("trimlab_python", "/opt/trimlab/venv/bin/python")

    def cli(self, name: str) -> str:
        v = self.rack.vars | self._vars(name)
        return v.get("trimlab_cli", "/opt/trimlab/venv/bin/trimlab")

    def _vars(self, name: str) -> dict:
        for e in [self.switch, *self.workers, *self.traffic, *([self.ps] if self.ps else [])]:
            if e.name == name:
                return e.vars
        return {}


def place(rack: inv.Rack, spec: ExperimentSpec) -> Placement:
    """Assign roles and check that the rack can run `spec` (before anything is touched)."""
    by_role = {r: [h for h in rack.hosts if h.role == r] for r in inv.ROLES}
    if not by_role["worker"]:
        raise SpecError(f"inventory {rack.path}: no host with role worker")
    if spec.topology == "ps" and not by_role["ps"]:
        raise SpecError(f"topology=ps: inventory {rack.path} has no host with role ps")
    if spec.topology == "sharded" and len(by_role["worker"]) < 2:
        raise SpecError(f"topology=sharded: inventory {rack.path} needs at least 2 workers")
    if spec.congestion.background and not by_role["traffic"]:
        raise SpecError("congestion.background: the rack has no traffic host; set "
                        "rack.virtual.traffic_hosts: 1 (or add a host with role traffic)")
    family = "data_ipv6" if spec.transport.ipv6 else "data_ipv4"
    for h in rack.hosts:
        if not h.vars.get(family):
            raise SpecError(f"host {h.name}: {family} is missing (transport.ipv6={spec.transport.ipv6})")
    if len(rack.switches) != 1:
        raise SpecError(f"inventory {rack.path}: a run drives one trimming switch, found {len(rack.switches)}")
    if "switch" in spec.capture.points and rack.switches[0].os != "vswitch":
        raise SpecError("capture.points: 'switch' needs the virtual switch (a real switch's ports "
                        "are captured with a tap or mirror port)")
    p = Placement(rack, rack.switches[0], by_role["worker"],
                  by_role["ps"][0] if spec.topology == "ps" else None, by_role["traffic"])
    for e in [p.switch, *p.workers, *p.traffic, *([p.ps] if p.ps else [])]:
        p.hosts[e.name] = remote.Host.from_inventory(e.name, e.vars, rack.vars)
    return p


# -- the run's switch profile -------------------------------------------------------------------

def effective_profile(spec: ExperimentSpec):
    """The named profile with the run's buffer (virtual rack) and injection applied."""
    prof = load_profile(spec.profile)
    data = prof.model_dump(mode="json")
    if spec.rack.virtual is not None:
        data["buffer"]["queue_bytes"] = spec.rack.virtual.buffer_bytes
    c = spec.congestion
    data["injection"] = {"probability": c.inject_probability, "action": c.inject_action, "seed": spec.seed}
    return type(prof).model_validate(data)


def check_profile(spec: ExperimentSpec, rack: inv.Rack | None) -> None:
    """Every target's limits, before the rack is touched."""
    from testbed.provision import render_profiles
    from testbed.targets import get_target

    prof = effective_profile(spec)
    if rack is None:
        get_target("vswitch").check(prof, list(get_target("vswitch").default_ports))
        return
    tmp = Path(_tmpdir())
    try:
        path = tmp / f"{prof.name}.yml"
        path.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False))
        render_profiles(rack, str(path), tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _tmpdir() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="trimlab-run-")


# -- the agents' configuration -------------------------------------------------------------------

def packet_coords(spec: ExperimentSpec, mtu: int) -> int:
    """Coordinates per packet: the spec's, checked against the MTU, or as many as fit."""
    from testbed import wire
    from testbed.codec import get_codec

    codec = get_codec(spec.codec.name, **spec.codec.params)
    best = wire.max_coords(codec, mtu, spec.transport.ipv6)
    if spec.codec.coords and spec.codec.coords > best:
        raise SpecError(f"codec.coords={spec.codec.coords}: does not fit mtu={mtu} with codec "
                        f"{codec.name}; at most {best}")
    return spec.codec.coords or min(best, spec.codec.span)


def agent_config(spec: ExperimentSpec, p: Placement, mtu: int, rate_bps: int) -> dict:
    from testbed.codec import get_codec
    from testbed.vrack.rack import parse_rate

    t = spec.transport
    codec = get_codec(spec.codec.name, **spec.codec.params)
    coords = packet_coords(spec, mtu)
    pacing = parse_rate(t.pacing) if t.pacing else None
    if pacing is None and not spec.congestion.incast and spec.topology == "ps":
        pacing = int(0.9 * rate_bps / len(p.workers))  # together, the workers fit the ps's port
    return {
        "name": spec.name, "job": spec.job, "seed": spec.seed, "steps": spec.workload.steps,
        "mtu": mtu, "topology": spec.topology,
        "workload": spec.workload.model_dump(mode="json"),
        "codec": {"name": codec.name, "params": codec.params(), "span": spec.codec.span, "coords": coords},
        "transport": {"dscp": t.dscp, "control_dscp": t.control_dscp, "deadline_ms": t.deadline_ms,
                      "pacing_bps": pacing, "port": t.port, "ipv6": t.ipv6},
        "truth_every": spec.truth.every, "eval_every": spec.workload.eval_every,
        "ps": {"name": p.ps.name, "addr": p.addr(p.ps, t.ipv6)} if p.ps else None,
        "workers": [{"name": w.name, "addr": p.addr(w, t.ipv6)} for w in p.workers],
        "timeouts": {"startup_s": 90.0, "step_s": 30.0, "params_s": 30.0, "give_up_s": 10.0},
        "max_missed_steps": 3,
    }


# -- one run --------------------------------------------------------------------------------------

@dataclass
class Agent:
    host: str
    kind: str  # worker | ps | capture | traffic | sink | sampler
    proc: remote.RemoteProcess
    essential: bool  # its failure fails the run


class Execution:
    """The agents of one run on one rack, and everything collected from them."""

    def __init__(self, spec: ExperimentSpec, place_: Placement, run: RunDir, rack_id: str | None,
                 mtu: int, rate_bps: int, console=None):
        self.spec, self.p, self.run, self.rack_id, self.console = spec, place_, run, rack_id, console
        self.cfg = agent_config(spec, place_, mtu, rate_bps)
        self.remote_dir = f"{REMOTE_ROOT}/{run.path.name}"
        self.agents: list[Agent] = []
        self.fleet: remote.Fleet | None = None
        self.progress = {"step": -1, "loss": None, "trimmed": 0, "acc": None}
        self.listening: dict[str, threading.Event] = {}
        self.script_results: dict[int, dict] = {}  # rank -> the DDP script's "done" line
        self.t0 = time.monotonic()

    def rdir(self, host: str) -> str:
        return f"{self.remote_dir}/{host}"

    def session(self, host: str) -> remote.Session:
        return self.fleet.sessions[host]

    def start(self, host: str, kind: str, argv: list[str], essential: bool, on_line=None, env=None) -> Agent:
        log = self.run.path / "logs" / f"{host}-{kind}.log"
        a = Agent(host, kind, self.session(host).start(argv, env=env, log=log, on_line=on_line), essential)
        self.agents.append(a)
        return a

    # phases
    def prepare(self) -> None:
        self.fleet = remote.Fleet.connect(list(self.p.hosts.values()))
        cfg_path = self.run.path / "agent.json"
        cfg_path.write_text(json.dumps(self.cfg, indent=2) + "\n")
        for name in self.p.hosts:
            s = self.session(name)
            s.run(["mkdir", "-p", self.rdir(name)], timeout=30).check()
            s.put(cfg_path, f"{self.rdir(name)}/agent.json")
        self.run.record(hosts=self.facts(), agent_config=self.cfg)
        if self.p.switch.os == "vswitch":
            self.counters("counters_before.json")

    def facts(self) -> dict:
        def one(name: str) -> dict:
            r = self.session(name).run(["uname", "-r"], timeout=20)
            return {"kernel": r.stdout.strip(), "address": self.p.hosts[name].address}
        return {name: one(name) for name in self.p.hosts}

    def counters(self, filename: str) -> dict:
        sw = self.p.switch.name
        r = self.session(sw).run([self.p.cli(sw), "switch", "counters", "--json",
                                  *self._rack_arg()], timeout=60).check()
        (self.run.path / "switch" / filename).write_text(r.stdout + "\n")
        return json.loads(r.stdout)

    def _rack_arg(self) -> list[str]:
        return ["--id", self.rack_id] if self.rack_id else []

    def _listening(self, key: str):
        ev = self.listening[key] = threading.Event()

        def on_line(line: str) -> None:
            if '"listening"' in line:
                ev.set()
        return on_line

    def start_observers(self) -> None:
        sw = self.p.switch.name
        if self.p.switch.os == "vswitch":
            self.start(sw, "sampler", [self.p.cli(sw), "switch", "sample", "--out",
                                       f"{self.rdir(sw)}/occupancy.csv", *self._rack_arg()], essential=False)
        port = self.spec.transport.port
        bpf = f"udp and (port {port} or port {port + 1})"
        points = self.spec.capture.points
        targets = []
        if "workers" in points:
            targets += [(w, self.spec.capture.sender_snaplen) for w in self.p.workers]
        if "ps" in points and self.p.ps:
            targets.append((self.p.ps, 0))
        flows = len(self.spec.congestion.background)
        for h, snap in targets:
            # the background flows' sink sees their trims too, so the switch's count can be matched
            f = bpf if not flows or h is not self.p.sink else \
                f"{bpf} or portrange {TRAFFIC_PORT}-{TRAFFIC_PORT + flows - 1}"
            argv = [self.p.python(h.name), "-m", "agents.capture", "--iface", h.data_if, "--snaplen",
                    str(snap), "--out", f"{self.rdir(h.name)}/pcaps", "--name", h.name, "--filter", f]
            self.start(h.name, "capture", argv, essential=True, on_line=self._listening(f"cap-{h.name}"))
        if "switch" in points:
            argv = [self.p.python(sw), "-m", "agents.capture", "--snaplen",
                    str(self.spec.capture.sender_snaplen), "--out", f"{self.rdir(sw)}/pcaps",
                    "--name", sw, "--filter", bpf]
            for port_name in self.p.switch.ports:
                argv += ["--iface", port_name]
            self.start(sw, "capture", argv, essential=True, on_line=self._listening(f"cap-{sw}"))
        self._wait_listening("capture")

    def _wait_listening(self, what: str, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        for key, ev in self.listening.items():
            while not ev.wait(0.1):
                self.check_agents()
                if time.monotonic() > end:
                    raise RunFailed(f"{key.split('-', 1)[1]}: {what} did not start within {timeout:g} s")
        self.listening.clear()

    def start_traffic(self) -> None:
        flows = self.spec.congestion.background
        if not flows:
            return
        sink_host = self.p.sink
        ipv6 = self.spec.transport.ipv6
        dst = self.p.addr(sink_host, ipv6)
        for i, f in enumerate(flows):
            port = str(TRAFFIC_PORT + i)
            self.start(sink_host.name, "sink", [self.p.python(sink_host.name), "-m", "agents.traffic",
                                                "sink", "--bind", dst, "--port", port, "--protocol", f.protocol],
                       essential=False, on_line=self._listening(f"sink{i}-{sink_host.name}"))
        self._wait_listening("traffic sink")
        for i, f in enumerate(flows):
            src = self.p.traffic[i % len(self.p.traffic)]
            self.start(src.name, f"traffic{i}", [
                self.p.python(src.name), "-m", "agents.traffic", "send", "--dst", dst,
                "--port", str(TRAFFIC_PORT + i), "--rate", f.rate, "--dscp", str(f.dscp),
                "--protocol", f.protocol, "--pattern", f.pattern, "--on-ms", str(f.on_ms),
                "--off-ms", str(f.off_ms)], essential=False)

    def _on_agent_line(self, line: str) -> None:
        if not line.startswith("{"):
            return
        try:
            ev = json.loads(line)
        except ValueError:
            return
        if ev.get("event") == "done" and "test_acc" in ev and "rank" in ev:  # a DDP script's own result
            self.script_results[ev["rank"]] = ev
            return
        if ev.get("event") != "step":
            return
        if ev.get("role") == "ps":
            self.progress["trimmed"] += ev.get("trimmed", 0)
            if ev.get("test_acc") not in (None, ""):
                self.progress["acc"] = ev["test_acc"]
        elif ev.get("rank") == 0:
            self.progress["step"] = ev["step"]
            self.progress["loss"] = ev["loss"]

    def start_training(self) -> None:
        if self.spec.workload.kind == "ddp":
            return self.start_ddp()
        for rank, w in enumerate(self.p.workers):
            self.start(w.name, "worker", [self.p.python(w.name), "-m", "agents.worker", "--config",
                                          f"{self.rdir(w.name)}/agent.json", "--rank", str(rank),
                                          "--out", self.rdir(w.name)],
                       essential=True, on_line=self._on_agent_line)
        if self.p.ps:
            self.start(self.p.ps.name, "ps", [self.p.python(self.p.ps.name), "-m", "agents.ps",
                                              "--config", f"{self.rdir(self.p.ps.name)}/agent.json",
                                              "--out", self.rdir(self.p.ps.name)],
                       essential=True, on_line=self._on_agent_line)

    def start_ddp(self) -> None:
        """The DDP script on every worker with torchrun's environment; gloo meets on the
        management network at rank 0, gradients go through the switch via the comm hook."""
        wl = self.spec.workload
        world = len(self.p.workers)
        master = self.p.hosts[self.p.workers[0].name].address
        for rank, w in enumerate(self.p.workers):
            env = {"MASTER_ADDR": master, "MASTER_PORT": str(DDP_PORT), "RANK": str(rank), "WORLD_SIZE": str(world),
                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "TRIMLAB_CONFIG": f"{self.rdir(w.name)}/agent.json",
                   "TRIMLAB_OUT": self.rdir(w.name)}
            if self.p.rack.virtual:  # every virtual host shares this machine's cores
                env |= {"GLOO_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "1"}
            argv = [self.p.python(w.name), ddp_script(self.spec), "--steps", str(wl.steps), "--batch", str(wl.batch),
                    "--lr", str(wl.lr), "--seed", str(self.spec.seed), "--comm", "trimlab"]
            self.start(w.name, "worker", argv, essential=True, on_line=self._on_agent_line, env=env)

    def check_agents(self) -> None:
        """A training or capture agent that exited with an error fails the run now."""
        for a in self.agents:
            if a.essential and not a.proc.running():
                rc = a.proc.wait(1)
                if rc != 0 or a.kind not in ("worker", "ps"):
                    log = self.run.path / "logs" / f"{a.host}-{a.kind}.log"
                    tail = [ln for ln in log.read_text().splitlines() if ln.strip()][-1:] if log.exists() else []
                    how = f"exited {rc}" if rc not in (None, -1) else "was killed"
                    raise RunFailed(f"host {a.host}: {a.kind} {how}" + (f": {tail[0]}" if tail else ""))

    def wait_training(self) -> None:
        steps = self.spec.workload.steps
        budget = 120 + steps * (self.spec.transport.deadline_ms / 1e3 + 2)
        trainers = [a for a in self.agents if a.kind in ("worker", "ps")]
        bar = _progress(self.console, steps)
        last = (time.monotonic(), 0)
        rate = 0.0
        with bar:
            task = bar.add_task("train", total=steps, loss="-", trims="0", rate="0")
            while any(a.proc.running() for a in trainers):
                self.check_agents()
                if time.monotonic() - self.t0 > budget:
                    raise RunFailed(f"training did not finish within {budget:.0f} s")
                now, trims = time.monotonic(), self.progress["trimmed"]
                if now - last[0] >= 1.0:
                    rate, last = (trims - last[1]) / (now - last[0]), (now, trims)
                loss = self.progress["loss"]
                bar.update(task, completed=self.progress["step"] + 1,
                           loss=f"{loss:.4f}" if loss is not None else "-", trims=str(trims), rate=f"{rate:.0f}")
                time.sleep(0.2)
            self.check_agents()
            bar.update(task, completed=steps)

    def stop(self) -> None:
        """Stop every agent still running, then disconnect: idempotent, never raises."""
        for a in reversed(self.agents):
            try:
                a.proc.stop()
            except (TrimlabError, OSError, EOFError):
                pass

    def collect(self) -> None:
        """Everything the agents wrote, over SFTP, into the run directory (best effort)."""
        errors = []
        for name in self.p.hosts:
            try:
                s = self.session(name)
                got = s.get_tree(self.rdir(name), self.run.path / "agents" / name)
                s.run(["rm", "-rf", self.rdir(name)], timeout=60)
                s.run(["rmdir", "--ignore-fail-on-non-empty", self.remote_dir], timeout=60)
            except (TrimlabError, OSError, EOFError) as exc:
                errors.append(f"{name}: {exc}")
                continue
            for f in got:  # pcaps and truth where the design puts them; the rest stays per host
                if f.parent.name == "pcaps":
                    f.replace(self.run.path / "pcaps" / f.name)
                elif f.parent.name == "truth":
                    f.replace(self.run.path / "truth" / f.name)
                elif f.name == "occupancy.csv":
                    f.replace(self.run.path / "switch" / "occupancy.csv")
        for d in (self.run.path / "agents").glob("*/*"):
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        if errors:
            self.run.record(collect_errors=errors)

    def results(self) -> dict:
        """The run's outcome from what was collected; RunFailed if the models diverged."""
        agents = self.run.path / "agents"
        finals = {d.name: json.loads((d / "final.json").read_text())
                  for d in agents.iterdir() if (d / "final.json").exists()} if agents.exists() else {}
        out: dict = {"wall_s": round(time.monotonic() - self.t0, 2), "steps": self.spec.workload.steps}
        before = self.run.path / "switch" / "counters_before.json"
        after = self.run.path / "switch" / "counters_after.json"
        if before.exists() and after.exists():
            b, a = json.loads(before.read_text())["switch"], json.loads(after.read_text())["switch"]
            out["switch"] = {k: a[k] - b[k] for k in a}
        workers = {n: f for n, f in finals.items() if f.get("role") == "worker"}
        for f in workers.values():  # the DDP hook knows gradients, the script its accuracy
            if f.get("test_acc") is None and f.get("rank") in self.script_results:
                f["test_acc"] = self.script_results[f["rank"]]["test_acc"]
        out["workers"] = {n: {"test_acc": f["test_acc"], "checksum": f["checksum"]} for n, f in workers.items()}
        checksums = {f["checksum"] for f in finals.values()}
        out["parameters_identical"] = len(checksums) == 1 and len(workers) == len(self.p.workers)
        ps = next((f for f in finals.values() if f.get("role") == "ps"), None)
        if ps:
            out["ps"] = {k: ps[k] for k in ("received", "trimmed", "missing", "expected", "discarded")}
        accs = [f["test_acc"] for f in finals.values()]
        out["test_acc"] = accs[0] if accs else None
        self.run.record(results=out)
        if len(workers) != len(self.p.workers):
            missing = sorted({w.name for w in self.p.workers} - set(workers))
            raise RunFailed(f"workers {', '.join(missing)} wrote no final.json")
        if not out["parameters_identical"]:
            raise RunFailed(f"parameters differ across hosts: {sorted(checksums)}")
        return out

    def execute(self) -> dict:
        try:
            self.prepare()
            self.start_observers()
            self.start_traffic()
            self.start_training()
            self.wait_training()
        finally:
            self.stop()
            if self.fleet is not None:
                if self.p.switch.os == "vswitch":
                    try:
                        self.counters("counters_after.json")
                    except (TrimlabError, OSError, EOFError, ValueError):
                        pass
                self.collect()
                self.fleet.close()
        return self.results()


def _progress(console, steps: int):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(), TextColumn("loss {task.fields[loss]}"),
                    TextColumn("trims {task.fields[trims]} ({task.fields[rate]}/s)"), TimeElapsedColumn(),
                    console=console, transient=False, disable=console is None)


# -- the command -----------------------------------------------------------------------------------

def _rack_key(spec: ExperimentSpec) -> tuple:
    v = spec.rack.virtual
    return (v.workers, v.traffic_hosts, v.rate, v.mtu, spec.topology)


def _provision(inventory: Path, profile_path: Path, switch_only: bool, console) -> None:
    from testbed import provision

    out = provision.run(inventory, profile=str(profile_path), console=console,
                        limit="trim_switches" if switch_only else None,
                        tags="trim_switch" if switch_only else None)
    if out.failures or out.rc != 0:
        first = out.failures[0] if out.failures else {"host": "-", "task": "-", "msg": out.status}
        raise RunFailed(f"provisioning failed: {first['host']}: {first['task']}: {first['msg']}")
    if console is not None:
        changed = sum(r.changed for r in out.hosts.values())
        console.print(f"provisioned {len(out.hosts)} hosts ({changed} changes)")


def run(spec_path: str, inventory: str | None = None, overrides: list[str] = (), keep_rack: bool = False,
        runs_dir: Path = Path("runs"), console=None) -> list[Path]:
    """Run every point of the spec; returns the run directories. RunFailed if any failed."""
    from testbed.rundir import sigterm_as_interrupt
    from testbed.vrack import rack as vrack

    spec = load_experiment(spec_path, overrides)
    points = spec.points()
    lab = inv.load(inventory) if inventory else None
    for pt in points:  # everything validated before anything is touched
        check_profile(pt, lab)
        if pt.workload.kind == "ddp" and lab is None and not Path(ddp_script(pt)).is_file():
            raise SpecError(f"workload.script={ddp_script(pt)}: no such file")
        packet_coords(pt, int(lab.vars.get("data_mtu", 1500)) if lab else pt.rack.virtual.mtu)
        if lab is not None:
            place(lab, pt)
    sigterm_as_interrupt()
    parent, sweep = runs_dir, None
    if len(points) > 1:  # the sweep's own directory and manifest; one run directory per point
        sweep = RunDir.create(runs_dir, spec)
        parent = sweep.path
        (parent / "sweep.json").write_text(json.dumps([p.name for p in points], indent=2) + "\n")
    state, key, provisioned, dirs, failures = None, None, False, [], []
    try:
        for pt in points:
            if lab is None and _rack_key(pt) != key:
                if state is not None:
                    vrack.down(state)
                    state = None
                v = pt.rack.virtual
                rid = "r" + secrets.token_hex(3)[:5]
                st = vrack.plan(rid, v.workers, 1 if pt.topology == "ps" else 0, v.traffic_hosts,
                                v.rate, v.mtu, 0.0)
                if console is not None:
                    console.print(f"bringing up virtual rack {rid} ({v.workers} workers, {v.rate})")
                state, key, provisioned = vrack.up(st), _rack_key(pt), False
            inventory_path = Path(inventory) if lab is not None else state.dir / "inventory.yml"
            rack = lab or inv.load(inventory_path)
            placement = place(rack, pt)
            mtu = int(rack.vars.get("data_mtu", 1500))
            rate = state.rate_bps if state else 1_000_000 * int(
                next(iter(placement.switch.ports.values())).get("speed_mbps", 100_000))
            with RunDir.create(parent, pt) as run_dir:
                dirs.append(run_dir.path)
                shutil.copy(inventory_path, run_dir.path / "inventory.yml")
                run_dir.record(inventory=str(inventory_path), rack_id=state.id if state else None)
                prof = effective_profile(pt)
                prof_path = run_dir.path / "switch" / f"{prof.name}.yml"
                prof_path.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False))
                try:
                    _provision(inventory_path, prof_path, switch_only=provisioned, console=console)
                    provisioned = True
                    ex = Execution(pt, placement, run_dir, state.id if state else None, mtu, rate, console)
                    results = ex.execute()
                except TrimlabError as exc:  # this point failed; the sweep goes on
                    failures.append(f"{pt.name}: {exc}")
                    run_dir.finish("failed", str(exc))
                    if console is not None:
                        console.print(f"[red]run {pt.name} failed:[/] {exc}  ({run_dir.path})")
                    continue
                if console is not None:
                    console.print(_summary(pt, results, run_dir.path))
            _report(run_dir.path, console)
    except BaseException as exc:
        if sweep is not None:
            sweep.finish("failed", "interrupted (Ctrl-C)" if isinstance(exc, KeyboardInterrupt)
                         else f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if state is not None and not keep_rack:
            vrack.down(state)
        elif state is not None and console is not None:
            console.print(f"rack {state.id} kept up: `trimlab rack down --id {state.id}` when done")
    if sweep is not None:
        sweep.record(points=[str(d.relative_to(parent)) for d in dirs])
        sweep.finish("failed" if failures else "succeeded", "; ".join(failures) or None)
        _report(parent, console, sweep=True)
    if failures:
        raise RunFailed("; ".join(failures) + f" (run directories under {parent})")
    return dirs


def _summary(spec: ExperimentSpec, r: dict, path: Path) -> str:
    sw = r.get("switch", {})
    ps = r.get("ps", {})
    acc = r.get("test_acc")
    return (f"[green]run {spec.name} succeeded[/] in {r['wall_s']:.1f} s: test accuracy "
            f"{'-' if acc is None else format(acc, '.3f')}, switch trims {sw.get('TRIM_PKTS', '-')}, drops {sw.get('DROP_PKTS', '-')}, "
            f"ps saw {ps.get('trimmed', '-')} trimmed of {ps.get('received', '-')} packets "
            f"({ps.get('missing', '-')} missing); parameters identical: {r['parameters_identical']}\n"
            f"  {path}")


def _report(path: Path, console, sweep: bool = False) -> None:
    """The analysis entry point: a run's report, or a sweep's comparison of its points.
    A report that cannot be written is said, and does not fail the run."""
    from analysis import report

    try:
        if sweep:
            out = report.compare([path], path / "report.html")
            if console is not None:
                console.print(f"sweep report: {out}")
        else:
            report.for_run(path, console=console)
    except (TrimlabError, OSError, ValueError) as exc:
        if console is not None:
            console.print(f"[yellow]report for {path} not written:[/] {exc}")
