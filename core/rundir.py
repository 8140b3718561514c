"""The run directory: `runs/<UTC time>-<name>/` with manifest.json, written as the run goes
so a failed or interrupted run keeps what it collected and says why.

    with RunDir.create(Path("runs"), spec) as run:   # status: running
        run.record(inventory=..., hosts={...})
        ...                                          # artifacts into run.path / LOGS ...
    # leaving the block: succeeded, or failed with the exception as the reason
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import importlib.metadata as md
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict

from trimlab import __version__
from trimlab.errors import TrimlabError

# -- the layout: the only place that names a file in a run directory ---------------------------
SCHEMA_VERSION = 1  # of this layout, in every manifest; bump it when a name or a format changes

MANIFEST = "manifest.json"
SPACE_RESERVE = ".space_reserve"  # freed for the manifest's last words when the disk fills
RESERVE_BYTES = 256 * 1024
AGENT_CONFIG = "agent.json"  # trimlab.config.AgentConfig, as the agents got it
INVENTORY = "inventory.yml"
SWEEP_POINTS = "sweep.json"  # a sweep's directory: the names of its points
REPORT = "report.html"
PACKETS_TABLE = "packets.parquet"
CHECKS = "checks.json"
LOGS, PCAPS, SWITCH, TRUTH, AGENTS = "logs", "pcaps", "switch", "truth", "agents"
SUBDIRS = (LOGS, PCAPS, SWITCH, TRUTH)
COUNTERS_BEFORE, COUNTERS_AFTER = "counters_before.json", "counters_after.json"  # in switch/
REPAIR_BEFORE, REPAIR_AFTER = "repair_before.json", "repair_after.json"  # each NIC host's receive repair
OCCUPANCY = "occupancy.csv"  # in switch/


def switch_dir(run: Path, label: str | None) -> Path:
    """Where a switch's counters and occupancy go: switch/ when the run drives one switch,
    switch/<label>/ per switch of a fabric (the manifest's `switches` lists them)."""
    return run / SWITCH / label if label else run / SWITCH


def switch_dirs(run: Path) -> dict[str | None, Path]:
    """The run's switch directories by label (None: the one switch of a single-switch run)."""
    top = run / SWITCH
    if (top / COUNTERS_BEFORE).exists() or (top / OCCUPANCY).exists():
        return {None: top}
    return {d.name: d for d in sorted(top.iterdir()) if d.is_dir()} if top.is_dir() else {}

# An agent's output folder (on its host; agents/<host>/ once collected): what every agent
# and the DDP hook write there. pcaps/ and truth/ move to the run's own folders.
FINAL = "final.json"
METRICS = "metrics.csv"  # trimlab.config.METRIC_FIELDS
PACKET_LOG = "packets.csv"  # trimlab.config.PACKET_LOG_FIELDS
STEPS = "steps.csv"  # the ps: trimlab.config.STEP_FIELDS
LAYOUT = "layout.json"
TRUTH_GLOB = "step*-rank*.npy"


class _AgentFile(BaseModel):
    """A JSON file an agent writes into its output folder; written and read only here."""

    model_config = ConfigDict(extra="forbid")
    FILE: ClassVar[str]

    def write(self, out_dir: Path) -> None:
        (out_dir / self.FILE).write_text(self.model_dump_json(indent=2, exclude_none=True) + "\n")

    @classmethod
    def read(cls, out_dir: Path):
        """The agent's file in `out_dir` (an agent's folder), None if it wrote none."""
        path = out_dir / cls.FILE
        return cls.model_validate_json(path.read_text()) if path.exists() else None


class Final(_AgentFile):
    """final.json: how an agent ended (a worker, the ps, a DDP rank's hook)."""

    FILE: ClassVar[str] = FINAL
    role: Literal["worker", "ps"]
    rank: int | None = None  # workers
    steps: int | None = None  # None: a DDP script without the hook said only its checksum
    checksum: str  # of the final parameters: equal on every host
    test_acc: float | None = None  # None: the DDP hook (its script knows the accuracy)
    test_loss: float | None = None
    wall_s: float | None = None
    numel: int | None = None  # the ps
    discarded: dict[str, int] = {}  # reason -> datagrams the agent discarded
    # the ps's gradient packets over the run
    received: int | None = None
    trimmed: int | None = None
    missing: int | None = None
    expected: int | None = None


Span = tuple[int, int]  # [lo, hi) of a worker's flattened gradient


class GradientLayout(_AgentFile):
    """layout.json: where a worker's wire buckets sit in its flattened gradient."""

    FILE: ClassVar[str] = LAYOUT
    numel: int
    rank: int
    topology: Literal["ps", "sharded", "ddp"]
    buckets: dict[int, Span]  # wire bucket -> its span
    owners: dict[int, int] = {}  # wire bucket -> the rank that reduces it (absent: the bucket's own number)
    # the DDP hook: buckets (and owners) of the steps before DDP rebuilt its buckets
    buckets_by_step: dict[int, dict[int, Span]] = {}
    owners_by_step: dict[int, dict[int, int]] = {}

    def at_step(self, step: int) -> tuple[dict[int, Span], dict[int, int]]:
        """The buckets and their owners in `step`."""
        return self.buckets_by_step.get(step, self.buckets), self.owners_by_step.get(step, self.owners)


def point_of(name: str) -> str:
    """A run's sweep point: its name without the `-s<seed>` that a spec's `seeds` adds."""
    return re.sub(r"-s\d+$", "", name)


def truth_file(step: int, rank: int) -> str:
    """The exact gradient of one rank at one step (truth/)."""
    return f"step{step:06d}-rank{rank}.npy"


def truth_key(name: str) -> tuple[int, int]:
    """(step, rank) of a truth_file name."""
    s, r = Path(name).stem.removeprefix("step").split("-rank")
    return int(s), int(r)


def log_file(host: str, kind: str) -> str:
    """What one agent printed (logs/): kind is worker, ps, capture, traffic0, ..."""
    return f"{host}-{kind}.log"


def pcap_file(name: str) -> str:
    return f"{name}.pcap"  # tcpdump -C rotates into NAME.pcap1, NAME.pcap2, ...


def capture_stats_file(name: str) -> str:
    return f"{name}.capture.json"  # tcpdump's own counts (pcaps/)


def profile_file(profile: str) -> str:
    return f"{profile}.yml"  # the run's effective switch profile (switch/)




def _git_revision() -> str | None:
    """The source tree's revision; None for an installed wheel (no tree to ask)."""
    root = Path(__file__).resolve().parent.parent
    if not (root / "pyproject.toml").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True,
                               text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (out.stdout.strip() + ("-dirty" if dirty else "")) if out.returncode == 0 else None


def versions() -> dict[str, str]:
    out = {"trimlab": __version__, "python": platform.python_version(), "kernel": platform.release()}
    for dist in ("torch", "numpy", "scapy", "ansible-core", "paramiko"):
        try:
            out[dist] = md.version(dist)
        except md.PackageNotFoundError:
            pass
    from trimlab.codec import kernels  # heavy (torch): the CLI starts without it

    # what encodes on CPU hosts of this kind: the native kernels or the torch reference
    out["codec_cpu"] = "native" if kernels.mode() != "torch" and kernels.available() else "torch"
    if out["codec_cpu"] == "native":  # and the vector path the kernels take on this CPU
        out["codec_isa"] = kernels.isa().name
    return out


class DiskFull(TrimlabError):
    """The run directory's filesystem filled up during a run."""

    exit_code = 1


Status = Literal["running", "succeeded", "failed", "interrupted"]


class Manifest(BaseModel):
    """manifest.json: what a run (or a sweep) was, how it went and what it measured. Fields
    are added as the run goes (`RunDir.record`); those here are the ones readers rely on,
    and a run kind may record more (kept as they are)."""

    model_config = ConfigDict(extra="allow")

    schema_version: int
    name: str
    status: Status
    reason: str | None = None
    started: str
    finished: str | None = None
    phase: str | None = None  # the phase the run is in (or was in when it ended)
    ended_in: str | None = None  # the phase a failure or a signal ended
    spec: dict = {}  # the resolved spec (trimlab.spec.ExperimentSpec, as JSON)
    seeds: dict = {}
    versions: dict[str, str] = {}
    git_revision: str | None = None
    command: list[str] = []
    pid: int | None = None
    owner: dict | None = None  # {pid, start, boot_id}: who holds the run while it runs
    inventory: str | None = None
    rack_id: str | None = None
    hosts: dict[str, dict] = {}  # host -> facts (role, addresses, port...)
    switches: list[str] = []  # the switches' labels
    links: list[tuple[str, str]] = []  # switch-to-switch links, label:port pairs
    platforms: dict[str, dict] = {}  # switch label -> {name, stale, needs_repair}
    results: dict = {}  # the outcome: accuracy, checksums, switch counters, background load
    points: list[str] = []  # a sweep: its points' run directories
    never_started: list[str] = []  # a sweep stopped early: the points it never began

    @classmethod
    def read(cls, run_dir: Path) -> "Manifest":
        return cls.model_validate_json((run_dir / MANIFEST).read_text())

    def shown_status(self) -> str:
        """The status as a reader should see it: a run still "running" whose owner is gone
        (SIGKILL, a crash, a reboot) died."""
        if self.status == "running" and self.owner is not None and not owner_alive(self.owner):
            return "died"
        return self.status


@dataclass
class RunDir:
    path: Path
    manifest: Manifest

    @classmethod
    def create(cls, runs: Path, spec, now: dt.datetime | None = None) -> "RunDir":
        """A new, unique run directory for `spec` (an ExperimentSpec), status running."""
        now = now or dt.datetime.now(dt.timezone.utc)
        stamp = now.strftime("%Y%m%dT%H%M%SZ")
        path = runs / f"{stamp}-{spec.name}"
        n = 1
        while True:
            try:
                path.mkdir(parents=True)
                break
            except FileExistsError:
                n += 1
                path = runs / f"{stamp}-{spec.name}-{n}"
        for sub in SUBDIRS:
            (path / sub).mkdir()
        manifest = Manifest(schema_version=SCHEMA_VERSION, name=spec.name, status="running", started=now.isoformat(),
                            spec=spec.model_dump(mode="json"), seeds={"seed": spec.seed, "job": spec.job},
                            versions=versions(), git_revision=_git_revision(), command=sys.argv, pid=os.getpid(),
                            owner=owner())
        # space set aside for the manifest's last words if the filesystem fills up
        (path / SPACE_RESERVE).write_bytes(bytes(RESERVE_BYTES))
        run = cls(path, manifest)
        run.save()
        return run

    def save(self) -> None:
        tmp = self.path / f"{MANIFEST}.tmp"
        text = json.dumps(self.manifest.model_dump(mode="json"), indent=2, sort_keys=True, default=str) + "\n"
        try:
            tmp.write_text(text)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno != errno.ENOSPC or not self._release_reserve():
                raise
            tmp.write_text(text)  # the reserve's space: the manifest can still say what happened
        tmp.replace(self.path / MANIFEST)  # readers never see half a manifest

    def _release_reserve(self) -> bool:
        """Free the space set aside at create; False if it was freed already."""
        reserve = self.path / SPACE_RESERVE
        if not reserve.exists():
            return False
        reserve.unlink()
        return True

    def record(self, **fields) -> None:
        """Add to the manifest (inventory, host facts, counters...) and write it now."""
        self._set(**fields)
        self.save()

    def _set(self, **fields) -> None:
        for k, v in fields.items():
            setattr(self.manifest, k, v)

    def finish(self, status: str, reason: str | None = None) -> None:
        if status not in ("succeeded", "failed", "interrupted"):
            raise ValueError(f"status {status!r}")
        self._set(status=status, reason=reason, finished=dt.datetime.now(dt.timezone.utc).isoformat())
        self._release_reserve()
        self.save()

    def enter_phase(self, name: str) -> None:
        """The phase the run is in now (the manifest names it if the run is interrupted)."""
        self.record(phase=name)

    def ended_in(self, name: str) -> None:
        """The phase an exception (a failure, a signal) ended; the first one counts, not the
        clean-up phases after it."""
        if self.manifest.ended_in is None:
            self.record(ended_in=name)

    def __enter__(self) -> "RunDir":
        on_overdue_stop(f"run {self.path}", self._overdue)
        return self

    def _overdue(self) -> None:
        sig = received_signal()
        self.finish("interrupted", f"interrupted by {signal.Signals(sig).name} during "
                    f"{self.manifest.ended_in or self.manifest.phase}; its clean-up overran "
                    f"{STOP_GRACE_S:g} s and was cut short")

    def __exit__(self, kind, exc, tb) -> bool:
        on_overdue_stop(f"run {self.path}", None)
        if exc is None:
            if self.manifest.status == "running":  # not already finished with a reason
                self.finish("succeeded")
        elif isinstance(exc, KeyboardInterrupt):
            self.finish("interrupted", interrupted_reason(exc, self.manifest.ended_in or self.manifest.phase))
        elif isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            reason = (f"no space left on device{f' writing {exc.filename}' if exc.filename else ''}: the "
                      f"filesystem of {self.path.parent} is full (free space, or give --runs on another one)")
            self.finish("failed", reason)
            raise DiskFull(reason) from None
        else:
            self.finish("failed", f"{type(exc).__name__}: {exc}")
        return False  # never swallow the exception


# -- owners: is the process that holds a run (or a rack) still there? ---------------------------

def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _start_ticks(pid: int) -> int | None:
    """A process's start time (clock ticks since boot): with its PID and the boot id it
    names the process, however the PID is reused later."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    return None if fields[0] == "Z" else int(fields[19])


def owner(pid: int | None = None) -> dict:
    """This process (or `pid`) as an owner record: PID, its start time and the boot id."""
    pid = os.getpid() if pid is None else pid
    return {"pid": pid, "start": _start_ticks(pid), "boot_id": _boot_id()}


def owner_alive(rec: dict | None) -> bool:
    """Whether the owner a record names still runs (on this boot, the same process)."""
    if not rec or not rec.get("pid"):
        return False
    if rec.get("boot_id") != _boot_id():
        return False
    start = _start_ticks(int(rec["pid"]))
    return start is not None and (rec.get("start") is None or start == rec["start"])


# -- stop signals -------------------------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) ended the work: unwinds like Ctrl-C, so every
    `finally` stops agents and takes racks down; the process then exits 128 + signum."""

    def __init__(self, signum: int):
        self.signum = signum
        super().__init__(f"interrupted by {signal.Signals(signum).name}")


_received: list[int] = []

# Clean-up after a stop signal is bounded: past this many seconds the process runs the
# registered last resorts (take down the racks it is building or owns) and exits 128 +
# signum, even when a step of the clean-up hangs (an unreachable host, a stuck collect).
STOP_GRACE_S = float(os.environ.get("TRIMLAB_STOP_GRACE_S", "45"))
_last_resorts: dict[str, Callable[[], None]] = {}


def on_overdue_stop(key: str, fn: Callable[[], None] | None) -> None:
    """Register (or, with None, drop) what to do if a stop's clean-up overruns its grace."""
    if fn is None:
        _last_resorts.pop(key, None)
    else:
        _last_resorts[key] = fn


def _overdue_stop(signum: int) -> None:
    print(f"error: clean-up after {signal.Signals(signum).name} took over {STOP_GRACE_S:g} s: "
          "taking down what is left and exiting", file=sys.stderr, flush=True)
    for key, fn in list(_last_resorts.items()):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the others still run; the exit still comes
            print(f"error: last-resort clean-up of {key} failed: {exc}", file=sys.stderr, flush=True)
    os._exit(128 + signum)


def received_signal() -> int | None:
    """The first stop signal this process received (None: none)."""
    return _received[0] if _received else None


_deferring = 0  # depth of stop_deferred() blocks open in the main thread
_deferred: list[int] = []  # the stop that arrived inside one, raised when the outermost ends


@contextlib.contextmanager
def stop_deferred():
    """A block a stop signal must not cut in half: one that arrives inside is raised as
    Interrupted when the block ends. For a command that creates rack state (cut short, it
    could still create it after the clean-up looked) and for starting a process whose
    handle must be kept (cut inside Popen, the child runs on with no one to stop it)."""
    global _deferring
    if threading.current_thread() is not threading.main_thread():  # handlers run only there
        yield
        return
    _deferring += 1
    try:
        yield
    finally:
        _deferring -= 1
        if not _deferring and _deferred:
            raise Interrupted(_deferred.pop())


def spawn(into: list[subprocess.Popen], argv: list[str], **kwargs) -> subprocess.Popen:
    """subprocess.Popen whose process is in `into` (the caller's list of what to stop) even
    when a stop signal arrives while it starts."""
    with stop_deferred():
        p = subprocess.Popen(argv, **kwargs)
        into.append(p)
    return p


def stop_signals_as_interrupt() -> None:
    """Make SIGINT, SIGTERM and SIGHUP raise Interrupted in the main thread, once: the
    first one unwinds (at the end of a stop_deferred block, when it arrives in one), the
    ones after it are noted and ignored, so that clean-up finishes; a clean-up that overruns
    STOP_GRACE_S is cut short by the last resorts."""
    def handler(signum, frame):
        _received.append(signum)
        if len(_received) == 1:
            timer = threading.Timer(STOP_GRACE_S, _overdue_stop, args=(signum,))
            timer.daemon = True  # a clean-up that finishes in time exits without waiting for it
            timer.start()
            if _deferring:
                _deferred.append(signum)
                return
            raise Interrupted(signum)

    for sig in STOP_SIGNALS:
        signal.signal(sig, handler)


def interrupted_reason(exc: BaseException, phase: str | None = None) -> str:
    signum = exc.signum if isinstance(exc, Interrupted) else signal.SIGINT
    name = signal.Signals(signum).name + (" (Ctrl-C)" if signum == signal.SIGINT else "")
    return f"interrupted by {name}" + (f" during {phase}" if phase else "")
