"""`trimlab provision`: validate the inventory and the profile for every switch OS, render
the profile per switch, then run playbooks/site.yml through ansible-runner with live
per-task progress and a per-host summary."""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from rich.table import Table

from trimlab.testbed import inventory as inv
from trimlab import resources
from trimlab.errors import TrimlabError
from trimlab.spec import load_profile
from trimlab.testbed.targets import Port, get_target
from trimlab.testbed.vrack import rack

PLAYBOOK_DIR = resources.playbooks()
CONNECT_TIMEOUT_S = 10


class ProvisionError(TrimlabError):
    """A provisioning run failed on some host (runtime failure: exit code 1)."""

    exit_code = 1


@dataclass
class HostResult:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: int = 0


@dataclass
class Outcome:
    status: str
    rc: int
    hosts: dict[str, HostResult]
    failures: list[dict] = field(default_factory=list)  # host, task, msg
    changes: list[dict] = field(default_factory=list)  # host, task

    @property
    def changed(self) -> int:
        return sum(h.changed for h in self.hosts.values())


def build_agent_wheel(out_dir: Path) -> Path:
    """This trimlab as a wheel, for the trimlab_agent role to install (with its [agent]
    extra) on real hosts. Built from a clean copy of the source tree (an in-tree build/
    can hold files since deleted); an installed trimlab has no tree, so there the inventory
    names a wheel (trimlab_agent_wheel)."""
    project = Path(__file__).resolve().parent.parent
    if not (project / "pyproject.toml").exists():
        raise ProvisionError("no trimlab source tree to build the hosts' wheel from: set trimlab_agent_wheel "
                             "in the inventory's vars to a trimlab wheel (pip wheel --no-deps trimlab)")
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="trimlab-wheel-") as tmp:
        src = Path(tmp) / "src"
        shutil.copytree(project, src, ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "*.egg-info", "runs", "__pycache__", ".pytest_cache", ".hypothesis"))
        argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out_dir), str(src)]
        if _build_backend_here():  # no index needed
            argv[4:4] = ["--no-build-isolation"]
        out = subprocess.run(argv, capture_output=True, text=True)
    wheels = sorted(out_dir.glob("trimlab-*.whl"))
    if out.returncode or not wheels:
        raise ProvisionError(f"building the trimlab wheel for the hosts failed: {out.stderr.strip()[-300:]}")
    return wheels[-1]


def _build_backend_here() -> bool:
    """Whether this environment has the build backend pyproject.toml asks for."""
    try:
        return int(md.version("setuptools").split(".")[0]) >= 77
    except (md.PackageNotFoundError, ValueError):
        return False


def render_profiles(rack, profile_name: str, out_dir: Path) -> dict[str, str]:
    """Render the profile for every switch into out_dir; every target's limits are checked
    here, before Ansible touches anything. Returns switch -> target."""
    profile = load_profile(profile_name)
    done = {}
    for sw in rack.switches:
        target = get_target(sw.os)
        target.configure(sw.name, {**rack.vars, **sw.vars})
        ports = [Port(name, d.get("facing", "host")) for name, d in sw.ports.items()]
        r = target.render(profile, ports)
        suffix = ".json" if r.config_format == "json" else ".yml"
        (out_dir / f"{sw.name}{suffix}").write_text(r.config_text())
        (out_dir / f"{sw.name}.commands").write_text("\n".join(r.commands) + "\n")
        done[sw.name] = sw.os
    return done


class Progress:
    """ansible-runner event handler: the current task and per-host counters."""

    def __init__(self, live=None):
        self.hosts: dict[str, HostResult] = {}
        self.failures: list[dict] = []
        self.changes: list[dict] = []
        self.task = ""
        self.live = live
        self.lock = threading.Lock()

    def __call__(self, event: dict) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data", {})
        host = data.get("host")
        with self.lock:
            if kind == "playbook_on_task_start":
                self.task = data.get("task", "")
            elif kind.startswith("runner_on_") and host:
                r = self.hosts.setdefault(host, HostResult())
                res = data.get("res", {}) or {}
                if kind == "runner_on_ok":
                    r.ok += 1
                    if res.get("changed"):
                        r.changed += 1
                        self.changes.append({"host": host, "task": data.get("task", "")})
                elif kind == "runner_on_failed" and not data.get("ignore_errors"):
                    r.failed += 1
                    self.failures.append({"host": host, "task": data.get("task", ""),
                                          "msg": _message(res)})
                elif kind == "runner_on_unreachable":
                    r.unreachable += 1
                    self.failures.append({"host": host, "task": data.get("task", ""),
                                          "msg": "unreachable: " + _message(res)})
                elif kind == "runner_on_skipped":
                    r.skipped += 1
        if self.live is not None:
            self.live.update(self.render())
        return True

    def render(self):
        t = Table("host", "ok", "changed", "failed", "unreachable", title=f"task: {self.task}")
        for h, r in sorted(self.hosts.items()):
            t.add_row(h, str(r.ok), str(r.changed), str(r.failed), str(r.unreachable))
        return t


def _message(res: dict) -> str:
    msg = res.get("msg") or res.get("stderr") or res.get("stdout") or ""
    return " ".join(str(msg).split())[:400]


def run(inventory: Path, profile: str = "default", check: bool = False, limit: str | None = None,
        tags: str | None = None, extravars: dict | None = None, console=None) -> Outcome:
    """Validate, render, run site.yml; raise nothing for host failures (see Outcome)."""
    import ansible_runner  # heavy (ansible): only when a playbook runs

    rack = inv.load(inventory)  # validated before anything is touched
    work = Path(tempfile.mkdtemp(prefix="trimlab-provision-"))
    try:
        rendered = work / "rendered"
        rendered.mkdir()
        render_profiles(rack, profile, rendered)
        if not rack.virtual and not rack.vars.get("trimlab_agent_wheel"):  # real hosts get this exact trimlab; virtual ones share our venv
            extravars = {"trimlab_agent_wheel": str(build_agent_wheel(work)), **(extravars or {})}
        cmdline = " ".join(["--check" if check else "", "--diff"]).strip()
        # ansible-playbook lives next to this interpreter (the venv), maybe not on PATH.
        bindir = str(Path(sys.executable).parent)
        if bindir not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        env = {
            "ANSIBLE_TIMEOUT": str(CONNECT_TIMEOUT_S),
            "ANSIBLE_SSH_RETRIES": "0",
            "ANSIBLE_PIPELINING": "True",
            "ANSIBLE_HOST_KEY_CHECKING": "True",
            "ANSIBLE_ROLES_PATH": str(PLAYBOOK_DIR / "roles"),
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_SSH_ARGS": f"-o ControlMaster=auto -o ControlPersist=60s -o ConnectTimeout="
                                f"{CONNECT_TIMEOUT_S} -o ServerAliveInterval=5 -o ServerAliveCountMax=2",
            "ANSIBLE_SSH_CONTROL_PATH_DIR": str(work / "cp"),  # per run: ends with the run
        }
        cancel = threading.Event()
        live_ctx = None
        if console is not None:
            from rich.live import Live
            live_ctx = Live(console=console, refresh_per_second=8, transient=True)
        progress = Progress(live_ctx)
        kwargs = dict(private_data_dir=str(work), project_dir=str(PLAYBOOK_DIR),
                      playbook=str(PLAYBOOK_DIR / "site.yml"), inventory=str(inventory.resolve()),
                      extravars={"trimlab_rendered_dir": str(rendered), "trimlab_profile": profile,
                                 **(extravars or {})},
                      envvars=env, cmdline=cmdline or None, limit=limit, tags=tags,
                      event_handler=progress, quiet=True, suppress_env_files=True,
                      # ours, so that ansible-runner installs no SIGINT/SIGTERM handlers of its own
                      # (they would outlive the playbook and swallow every later signal)
                      cancel_callback=cancel.is_set)
        with live_ctx or contextlib.nullcontext():
            thread, runner = ansible_runner.run_async(**kwargs)
            try:
                thread.join()
            except BaseException:  # interrupted: the runner stops ansible-playbook, then we go on
                cancel.set()
                thread.join(timeout=60)
                raise
        failures = progress.failures
        if runner.rc != 0 and not failures:  # Ansible itself failed (syntax, inventory...)
            tail = (runner.stdout.read() if runner.stdout else "").strip().splitlines()[-3:]
            failures = [{"host": "-", "task": "ansible-playbook", "msg": " ".join(tail) or runner.status}]
        return Outcome(runner.status, runner.rc, progress.hosts, failures, progress.changes)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def default_inventory(rack_id: str | None) -> Path:
    """Without -i: the running virtual rack's inventory."""
    return rack.resolve(rack_id).inventory


__all__ = ["Outcome", "ProvisionError", "default_inventory", "render_profiles", "run"]
