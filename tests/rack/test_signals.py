"""Stopped by a signal at any phase — SIGINT, SIGTERM or SIGHUP, as `timeout`, CI runners,
Slurm, systemd and terminals send them — trimlab stops its agents, takes its rack down,
keeps what the run collected, records the run as interrupted (which signal, which phase)
and exits with 128 + the signal number. Each case waits for the phase to be reached (the
manifest names it; the rack's namespaces exist), never for a time."""

import json
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


@pytest.mark.parametrize("sig,phase", [(signal.SIGTERM, "training"), (signal.SIGHUP, "training"),
                                       (signal.SIGINT, "training"), (signal.SIGTERM, "provision")],
                         ids=["SIGTERM-training", "SIGHUP-training", "SIGINT-training", "SIGTERM-provision"])
def test_a_signalled_run_is_interrupted_and_leaves_nothing(tmp_path, sig, phase):
    spec = write_spec(tmp_path, name="sig", workload={"kind": "digits", "model": "mlp", "steps": 5000,
                                                       "batch": 32, "lr": 0.1, "momentum": 0.9})
    runs = tmp_path / "runs"
    proc = subprocess.Popen([TRIMLAB, "run", str(spec), "--runs", str(runs)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        run_dir = wait_for(lambda: _phase(runs, phase, step=3 if phase == "training" else 0), proc,
                           f"phase {phase}")
        rack_id = manifest(run_dir)["rack_id"]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig, err[-3000:]
    m = manifest(run_dir)
    assert m["status"] == "interrupted", m
    assert m["reason"] == f"interrupted by {sig.name}" + (" (Ctrl-C)" if sig == signal.SIGINT else "") + f" during {phase}"
    if phase == "training":  # what it collected is kept
        assert any((run_dir / "logs").iterdir()) and (run_dir / "agents").exists()
    assert_nothing_of(rack_id)
    listing = subprocess.run([TRIMLAB, "runs", str(runs)], capture_output=True, text=True, cwd=ROOT)
    assert "interrupted" in listing.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_rack_up_signalled_midway_takes_down_what_it_built(sig):
    rid = new_id()
    proc = subprocess.Popen([TRIMLAB, "rack", "up", "--id", rid, "--workers", "4"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: leftovers(rid)["namespaces"], proc, "the first namespace")
        proc.send_signal(sig)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + sig
    assert_nothing_of(rid)


def test_bench_transport_signalled_takes_its_rack_down():
    proc = subprocess.Popen([TRIMLAB, "bench", "transport", "--quick", "--json"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # the bench's rack is up: its ps's sshd answers (its known_hosts is written last)
        from trimlab.vrack import rack
        wait_for(lambda: (rack.racks_dir() / "btr" / "inventory.yml").exists(), proc, "the bench's rack")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert json.loads(out or "null") is None  # no half result printed as if complete
    assert_nothing_of("btr")


def test_sigkill_leaves_a_died_run_and_a_stale_rack_that_reclaim_removes_alone(tmp_path):
    """SIGKILL cannot be handled: the run shows as `died` (never `running`), doctor and the
    next run name the stale rack, and `rack down --stale` removes it — and not a rack whose
    owner lives, nor one left up on purpose."""
    from trimlab.vrack import rack
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
