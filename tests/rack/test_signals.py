"""Stopped by a signal at any phase — SIGINT, SIGTERM or SIGHUP, as `timeout`, CI runners,
Slurm, systemd and terminals send them — trimlab stops its agents, takes its rack down,
keeps what the run collected, records the run as interrupted (which signal, which phase)
and exits with 128 + the signal number. Each case waits for the phase to be reached (the
manifest names it; the rack's namespaces exist), never for a time."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.rack.conftest import ROOT, new_id, require_root
from tests.rack.test_rack import leftovers
from tests.rack.test_run import TRIMLAB, manifest, write_spec


@pytest.fixture(autouse=True)
def _root():
    require_root()


def rack_processes(rack_id: str) -> list[int]:
    """Processes of the rack (its sshd daemons, agents) still running: their command
    lines name the rack's directory or they live in one of its namespaces."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"/racks/{rack_id}/" in cmd:
            out.append(int(proc.name))
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    for n in (n for n in ns if n.startswith(f"tl{rack_id}-")):
        out += [int(p) for p in subprocess.run(["ip", "netns", "pids", n], capture_output=True,
                                               text=True).stdout.split()]
    return out


def assert_nothing_of(rack_id: str) -> None:
    assert leftovers(rack_id) == {"namespaces": [], "links": [], "pins": [], "dir": False}
    assert rack_processes(rack_id) == []


def wait_for(predicate, proc: subprocess.Popen, what: str, limit: float = 300):
    """Poll until `predicate()` is truthy (the event); the limit only stops a hung test."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"exited {proc.returncode} before {what}: {err[-2000:]}")
        time.sleep(0.05)
    pytest.fail(f"never reached {what}")


def _run_dir(runs: Path):
    dirs = [d for d in runs.glob("*") if (d / "manifest.json").exists()] if runs.exists() else []
    return dirs[0] if dirs else None


def _phase(runs: Path, phase: str, step: int = 0):
    d = _run_dir(runs)
    if d is None:
        return None
    try:
        m = manifest(d)
    except ValueError:  # being written
        return None
    if m.get("phase") != phase:
        return None
    if step:  # and a worker has logged this step
        logs = list(d.glob("logs/*-w1-worker.log"))
        if not logs or f'"step": {step}' not in logs[0].read_text().replace('"step":', '"step": '):
            return None
    return d


def _cmdlines() -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                out.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
            except OSError:
                pass
    return out


def _running(fragment: str) -> bool:
    return any(fragment in c for c in _cmdlines())


def _running_in(rack_id: str, fragment: str) -> bool:
    """A process of the rack's namespaces runs `fragment` (not one of another test's, or of
    anyone else's training on this host)."""
    for ns in leftovers(rack_id)["namespaces"]:
        for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if fragment in cmdline:
                return True
    return False


def _namespaces_of(rack_id: str) -> bool:
    return bool(leftovers(rack_id)["namespaces"])


# command -> its argv (given a tmp dir and a fresh rack id), the rack id it builds, and its
# two phases: name -> the event that says the phase is under way
LONG_TRAINING = {"kind": "digits", "model": "mlp", "steps": 5000, "batch": 32, "lr": 0.1, "momentum": 0.9}
MATRIX = {
    "run": (lambda tmp, rid: ["run", str(write_spec(tmp, name="sig", workload=LONG_TRAINING)),
                              "--runs", str(tmp / "runs")],
            None,  # a run picks its rack id: the manifest names it
            {"provision": lambda tmp, rid: _phase(tmp / "runs", "provision"),
             "training": lambda tmp, rid: _phase(tmp / "runs", "training", step=3)}),
    "rack up": (lambda tmp, rid: ["rack", "up", "--id", rid, "--workers", "4"], "",
                {"namespaces": lambda tmp, rid: _namespaces_of(rid),
                 "daemons": lambda tmp, rid: _running(f"/racks/{rid}/run/sshd_")}),
    "bench transport": (lambda tmp, rid: ["bench", "transport", "--quick", "--json"], "btr",
                        {"rack": lambda tmp, rid: _namespaces_of(rid),
                         "measuring": lambda tmp, rid: _running_in(rid, "-m trimlab.bench.transport_rate")}),
    "bench ddp": (lambda tmp, rid: ["bench", "ddp", "--quick", "--json"], "bdd",
                  {"rack": lambda tmp, rid: _namespaces_of(rid),
                   "training": lambda tmp, rid: _running_in(rid, "ddp_train.py")}),
}



def _cases() -> list[tuple[str, str, signal.Signals]]:
    """Every command gets every stop signal and both its phases see one: the three signals
    share one handler (rundir.STOP_SIGNALS), so a full command × phase × signal product
    would run the same path twice. The rotation gives each phase each signal across the
    commands."""
    out = []
    sigs = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
    for k, (cmd, (_, _, phases)) in enumerate(MATRIX.items()):
        first, second = list(phases)
        rot = sigs[k % 3:] + sigs[:k % 3]
        out += [(cmd, first, rot[0]), (cmd, second, rot[1]), (cmd, second if k % 2 else first, rot[2])]
    return out


CASES = _cases()


@pytest.mark.parametrize("command,phase,sig", CASES, ids=[f"{c.replace(' ', '-')}-{p}-{s.name}" for c, p, s in CASES])
def test_a_signalled_command_exits_128_plus_signum_and_leaves_nothing(tmp_path, command, phase, sig):
    """Every command that builds state, stopped by each stop signal and in both its phases:
    exit 128 + signum, nothing of its rack left (namespaces, links, pins, processes); a run
    records `interrupted` with the signal and the phase and keeps what it collected; a
    bench prints no half result."""
    argv, rid, phases = MATRIX[command]
    rid = new_id() if rid == "" else rid
    proc = subprocess.Popen([TRIMLAB, *argv(tmp_path, rid)], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        reached = wait_for(lambda: phases[phase](tmp_path, rid), proc, f"{command}: phase {phase}")
        proc.send_signal(sig)
        signalled = time.monotonic()
        out, err = proc.communicate(timeout=300)
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    _record(command, phase, sig, proc.returncode, took)
    assert proc.returncode == 128 + sig, err[-3000:]
    assert "clean-up after" not in err, err[-3000:]  # ended within its grace, not cut short
    if command == "run":
        run_dir = reached
        rid = manifest(run_dir)["rack_id"]
        m = manifest(run_dir)
        assert m["status"] == "interrupted", m
        name = sig.name + (" (Ctrl-C)" if sig == signal.SIGINT else "")
        assert m["reason"] == f"interrupted by {name} during {phase}"
        if phase == "training":  # what it collected is kept
            assert any((run_dir / "logs").iterdir()) and (run_dir / "agents").exists()
        listing = subprocess.run([TRIMLAB, "runs", str(tmp_path / "runs")], capture_output=True, text=True, cwd=ROOT)
        assert "interrupted" in listing.stdout
    elif command.startswith("bench"):
        assert out.strip() == ""  # no half result printed as if complete
    assert_nothing_of(rid)


def _record(command, phase, sig, rc, took):
    """With TRIMLAB_SIGNAL_MATRIX=FILE, each case appends its outcome (the docs' table)."""
    path = os.environ.get("TRIMLAB_SIGNAL_MATRIX")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"command": command, "phase": phase, "signal": sig.name, "exit": rc,
                                "signal_to_exit_s": round(took, 2)}) + "\n")


def test_sigkill_leaves_a_died_run_and_a_stale_rack_that_reclaim_removes_alone(tmp_path):
    """SIGKILL cannot be handled: the run shows as `died` (never `running`), doctor and the
    next run name the stale rack, and `rack down --stale` removes it — and not a rack whose
    owner lives, nor one left up on purpose."""
    from trimlab.testbed.vrack import rack
    spec = write_spec(tmp_path, name="killed", workload={"kind": "digits", "model": "mlp", "steps": 5000,
                                                          "batch": 32, "lr": 0.1, "momentum": 0.9})
    runs = tmp_path / "runs"
    kept = [rack.up(rack.plan(new_id(), 1, 0, 0, "100mbit", 1500, 0), owned=True),  # owner: this process
            rack.up(rack.plan(new_id(), 1, 0, 0, "100mbit", 1500, 0))]  # `rack up`: no owner
    proc = subprocess.Popen([TRIMLAB, "run", str(spec), "--runs", str(runs)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: _phase(runs, "training", step=3), proc, "training")
        rack_id = manifest(run_dir)["rack_id"]
        proc.kill()
        proc.communicate(timeout=60)
        assert manifest(run_dir)["status"] == "running"  # as the killed process left it
        listing = subprocess.run([TRIMLAB, "runs", str(runs)], capture_output=True, text=True, cwd=ROOT)
        assert "died" in listing.stdout and "running" not in listing.stdout, listing.stdout
        assert rack_id in rack.stale() and not {k.id for k in kept} & set(rack.stale())
        doctor = json.loads(subprocess.run([TRIMLAB, "doctor", "--json"], capture_output=True, text=True,
                                           cwd=ROOT).stdout)
        check = next(c for c in doctor if c["name"] == "stale racks")
        assert not check["ok"] and rack_id in check["detail"]
        out = subprocess.run([TRIMLAB, "rack", "down", "--stale"], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0 and f"rack {rack_id} reclaimed" in out.stdout, out.stdout + out.stderr
        assert_nothing_of(rack_id)
        assert not Path(f"/var/tmp/trimlab/{run_dir.name}").exists()  # the hosts' run files went too
        for k in kept:
            assert leftovers(k.id)["namespaces"] and rack_processes(k.id)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for k in kept:
            rack.down(k)
