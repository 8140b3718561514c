"""One run on one rack, phase by phase: prepare the hosts, start the observers (sampler,
captures), the background traffic and the training agents, wait for training, then stop
everything, collect and compute the results."""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from trimlab import rundir
from trimlab.testbed import remote
from trimlab.errors import TrimlabError
from trimlab.testbed.orchestrator import artifacts, launch
from trimlab.testbed.orchestrator.monitor import Agent, Monitor
from trimlab.config import REMOTE_ROOT
from trimlab.testbed.orchestrator.placement import Placement, RunFailed, agent_config
from trimlab.testbed.orchestrator.progress import TrainingView
from trimlab.rundir import RunDir
from trimlab.spec import ExperimentSpec


class Execution:
    """The agents of one run on one rack, and everything collected from them."""

    def __init__(self, spec: ExperimentSpec, place_: Placement, run: RunDir, rack_id: str | None,
                 mtu: int, rate_bps: int, console=None):
        self.spec, self.p, self.run, self.rack_id, self.console = spec, place_, run, rack_id, console
        self.cfg = agent_config(spec, place_, mtu, rate_bps)
        self.remote_dir = f"{REMOTE_ROOT}/{run.path.name}"
        self.fleet: remote.Fleet | None = None
        self.monitor = Monitor(run.path / rundir.LOGS, spec.workload.steps)
        self.t0 = time.monotonic()
        self.phases: dict[str, float] = {}  # seconds per phase, in the manifest as phases_s

    @contextlib.contextmanager
    def phase(self, name: str):
        self.run.enter_phase(name)
        t = time.monotonic()
        try:
            yield
        except BaseException:
            self.run.ended_in(name)
            raise
        finally:
            self.phases[name] = round(time.monotonic() - t, 2)

    def rdir(self, host: str, *parts: str) -> str:
        return "/".join([self.remote_dir, host, *parts])

    def session(self, host: str) -> remote.Session:
        return self.fleet.sessions[host]

    def start(self, host: str, kind: str, argv: list[str], essential: bool, on_line=None, env=None) -> Agent:
        log = self.run.path / rundir.LOGS / rundir.log_file(host, kind)
        a = Agent(host, kind, self.session(host).start(argv, env=env, log=log, on_line=on_line), essential)
        self.monitor.agents.append(a)
        return a

    def _rack_args(self) -> list[str]:
        """Which virtual rack the switch commands address: the run's own, or the one a
        virtual rack's inventory names (given with -i, while other racks may be up)."""
        rid = self.rack_id or self.p.rack.vars.get("trimlab_rack_id")
        return ["--id", str(rid)] if rid else []

    # phases
    def prepare(self) -> None:
        self.fleet = remote.Fleet.connect(list(self.p.hosts.values()))
        cfg_path = self.run.path / rundir.AGENT_CONFIG
        self.cfg.write(cfg_path)

        def one(name: str, s: remote.Session) -> None:
            s.run(["mkdir", "-p", self.rdir(name)], timeout=30).check()
            s.put(cfg_path, self.rdir(name, rundir.AGENT_CONFIG))
        self.fleet.each(one)
        self.run.record(hosts=self.facts(), agent_config=self.cfg.model_dump(mode="json"),
                        switches=[self.p.label(sw) for sw in self.p.switches], links=self.p.links(),
                        platforms=self.p.platforms())
        self.counters(rundir.COUNTERS_BEFORE)
        self.repairs(rundir.REPAIR_BEFORE)
        self.preflight_repairs()

    def facts(self) -> dict:
        """Per host: kernel, management address, role, data addresses and switch port (the
        analysis reads these from the manifest)."""
        def one(name: str, s: remote.Session) -> dict:
            r = s.run(["uname", "-r"], timeout=20)
            entry = self.p.entry(name)
            out = {"kernel": r.stdout.strip(), "address": self.p.hosts[name].address,
                   "role": getattr(entry, "role", "switch")}
            if entry not in self.p.switches:
                out |= {k: entry.vars[k] for k in ("data_ipv4", "data_ipv6") if entry.vars.get(k)}
                sw, out["switch_port"] = self.p.switch_of(name)
                out["switch"] = self.p.label(sw)
            return out
        return self.fleet.each(one)

    def switch_dir(self, sw) -> Path:
        return rundir.switch_dir(self.run.path, self.p.label(sw) if len(self.p.switches) > 1 else None)

    def counters(self, filename: str) -> None:
        """Every virtual switch's counters, each into its switch directory."""
        for sw in self.p.virtual_switches:
            r = self.session(sw.name).run(launch.counters(self.p, sw, self._rack_args()), timeout=60).check()
            json.loads(r.stdout)  # a switch that answers something else fails here, not in the analysis
            d = self.switch_dir(sw)
            d.mkdir(parents=True, exist_ok=True)
            (d / filename).write_text(r.stdout + "\n")

    def repairs(self, filename: str) -> None:
        """Each NIC host's receive repair (its port and counters; null: the host has none),
        the fourth observer of a trim."""
        def one(name: str, s: remote.Session):
            try:
                r = s.run(launch.repair_status(self.p, name, self.p.entry(name).data_if), timeout=60)
            except remote.RemoteError as exc:
                return {"error": str(exc)}
            return json.loads(r.stdout) if r.rc == 0 else {"error": (r.stderr.strip() or r.stdout)[-300:]}
        hosts = [e.name for e in self.p.entries() if e not in self.p.switches]
        out = self.fleet.each(one, hosts)
        (self.run.path / filename).write_text(json.dumps(out, indent=2) + "\n")

    def preflight_repairs(self) -> None:
        """Refuse to train through a switch that leaves trimmed packets' lengths stale into
        a receiver without the receive repair (or with one for another port): its kernel
        would drop every trim and the run would measure drops, not trims."""
        status = json.loads((self.run.path / rundir.REPAIR_BEFORE).read_text())
        port = self.spec.transport.port
        for host in ([w.name for w in self.p.workers] if self.spec.topology == "sharded" else [self.p.ps.name]):
            sw = self.p.switch_of(host)[0]
            plat = self.p.platform(sw)
            if not plat.needs_repair:
                continue
            s, data_if = status.get(host), self.p.entry(host).data_if
            fix = (f"provision with nic_host_repair: true (nic_host_repair_port: {port}), or on the host "
                   f"`python -m trimlab.agents.repair install --dev {data_if} --port {port}`")
            if s is None or "error" in s:
                why = "no receive repair" if s is None else f"its receive repair cannot be read ({s['error']})"
                raise RunFailed(f"host {host}: {why} on {data_if}, and switch {sw.name} ({plat.name}) leaves "
                                   f"{', '.join(plat.stale)} of trimmed packets stale, so its kernel would drop "
                                   f"every trim; {fix}")
            if s["port"] != port:
                raise RunFailed(f"host {host}: the receive repair on {data_if} repairs UDP port {s['port']}, the "
                                   f"run sends gradients to {port} (transport.port); {fix}")

    def start_observers(self) -> None:
        spec, m = self.spec, self.monitor
        for sw in self.p.virtual_switches:
            # essential: it also watches that the program stays attached to every port
            self.start(sw.name, "sampler", launch.sampler(self.p, sw, self.rdir(sw.name, rundir.OCCUPANCY),
                                                          self._rack_args()), essential=True)
        points = spec.capture.points
        targets = []
        if "workers" in points:
            targets += [(w, spec.capture.sender_snaplen) for w in self.p.workers]
        if "ps" in points and self.p.ps:
            targets.append((self.p.ps, 0))
        flows = len(spec.congestion.background)
        for h, snap in targets:
            bpf = launch.capture_filter(spec, flows if h is self.p.sink else 0)
            argv = launch.capture(self.p, h.name, [h.data_if], snap, self.rdir(h.name, rundir.PCAPS), bpf)
            self.start(h.name, "capture", argv, essential=True, on_line=m.readiness(f"cap-{h.name}"))
        for sw in self.p.switches if "switch" in points else ():
            argv = launch.capture(self.p, sw.name, list(sw.ports), spec.capture.sender_snaplen,
                                  self.rdir(sw.name, rundir.PCAPS), launch.capture_filter(spec))
            self.start(sw.name, "capture", argv, essential=True, on_line=m.readiness(f"cap-{sw.name}"))
        m.wait_ready("capture")

    def start_traffic(self) -> None:
        flows = self.spec.congestion.background
        if not flows:
            return
        sink = self.p.sink
        dst = self.p.addr(sink, self.spec.transport.ipv6)
        for i, f in enumerate(flows):
            self.start(sink.name, f"sink{i}", launch.sink(self.p, i, f, dst), essential=False,
                       on_line=self.monitor.readiness(f"sink{i}-{sink.name}"))
        self.monitor.wait_ready("traffic sink")
        for i, f in enumerate(flows):
            src = self.p.traffic[i % len(self.p.traffic)]
            self.start(src.name, f"traffic{i}", launch.traffic(self.p, src.name, i, f, self.spec.flow_dscp(f), dst,
                                                               self.cfg.mtu),
                       essential=False)

    def start_training(self) -> None:
        on_line = self.monitor.on_training_line
        for rank, w in enumerate(self.p.workers):
            config, out = self.rdir(w.name, rundir.AGENT_CONFIG), self.rdir(w.name)
            if self.spec.workload.kind == "ddp":
                argv, env = launch.ddp(self.p, self.spec, rank, config, out)
                self.start(w.name, "worker", argv, essential=True, on_line=on_line, env=env)
            else:
                self.start(w.name, "worker", launch.worker(self.p, w.name, rank, config, out), essential=True,
                           on_line=on_line)
        if self.p.ps and self.spec.workload.kind != "ddp":
            ps = self.p.ps.name
            self.start(ps, "ps", launch.ps(self.p, self.rdir(ps, rundir.AGENT_CONFIG), self.rdir(ps)),
                       essential=True, on_line=on_line)

    def wait_training(self) -> None:
        steps = self.spec.workload.steps
        per_step = self.spec.transport.deadline_ms / 1e3 + 2
        budget = 120 + steps * per_step
        if self.spec.workload.time_limit_s:  # it stops at the first evaluation past the limit
            budget = min(budget, 120 + self.spec.workload.time_limit_s + self.spec.workload.eval_every * per_step)
        with TrainingView(self.console, steps) as view:
            self.monitor.wait_training(budget, self.t0, view)

    def execute(self) -> dict:
        try:
            for name, step in (("prepare", self.prepare), ("observers", self.start_observers),
                               ("traffic", self.start_traffic), ("launch", self.start_training),
                               ("training", self.wait_training)):
                with self.phase(name):
                    step()
        finally:
            with self.phase("stop"):
                self.monitor.stop()
            if self.fleet is not None:
                with self.phase("collect"):
                    try:
                        self.counters(rundir.COUNTERS_AFTER)
                        self.repairs(rundir.REPAIR_AFTER)
                    except (TrimlabError, OSError, EOFError, ValueError):
                        pass
                    try:
                        artifacts.collect(self.run, self.fleet, {n: self.rdir(n) for n in self.p.hosts},
                                        self.remote_dir, {sw.name: self.switch_dir(sw) for sw in self.p.switches})
                    finally:
                        self.fleet.close()
                        if self.rack_id:  # a virtual rack's hosts share this machine's files: what
                            # they could not remove (a host cut off, a collection that failed) goes now
                            shutil.rmtree(self.remote_dir, ignore_errors=True)
            self.run.record(phases_s=self.phases)
        return artifacts.results(self.run, self.p, self.spec.workload.steps, self.monitor.training.script_results,
                               self.t0)
