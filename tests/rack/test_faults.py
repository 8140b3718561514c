"""Faults inside a run, each ending it with a named cause, the rack torn down and nothing
left: the switch's program detached from a port, a host's sshd killed, the run
directory's filesystem full. Each waits for training to be under way (a worker logged a
step), never for a time."""

import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.rack.conftest import ROOT, require_root
from tests.rack.test_run import TRIMLAB, manifest, write_spec
from tests.rack.test_signals import _phase, assert_nothing_of, wait_for


@pytest.fixture(autouse=True)
def _root():
    require_root()


def start_long_run(tmp_path, name):
    spec = write_spec(tmp_path, name=name, workload={"kind": "digits", "model": "mlp", "steps": 5000,
                                                      "batch": 32, "lr": 0.1, "momentum": 0.9})
    runs = tmp_path / "runs"
    proc = subprocess.Popen([TRIMLAB, "run", str(spec), "--runs", str(runs)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    run_dir = wait_for(lambda: _phase(runs, "training", step=3), proc, "training")
    return proc, run_dir, manifest(run_dir)["rack_id"]


def finish(proc):
    try:
        return proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_detached_switch_program_fails_the_run_by_name(tmp_path):
    proc, run_dir, rid = start_long_run(tmp_path, "detach")
    sw = f"tl{rid}-sw"
    subprocess.run(["nsenter", f"--net=/run/netns/{sw}", "tc", "filter", "del", "dev", "Ethernet8", "egress"],
                   check=True)
    out, err = finish(proc)
    assert proc.returncode == 1, err[-2000:]
    m = manifest(run_dir)
    assert m["status"] == "failed" and m["ended_in"] == "training", m
    assert (f"host {sw}: sampler exited 2: error: the trimming program is no longer attached to Ethernet8 "
            "(its tc egress filter is gone)") in m["reason"], m["reason"]
    assert_nothing_of(rid)


def test_a_killed_sshd_fails_the_run_by_name(tmp_path):
    proc, run_dir, rid = start_long_run(tmp_path, "sshd")
    ns = f"tl{rid}-w1"
    # every sshd of the host: the listening daemon and the sessions the run holds
    pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=True).stdout.split()
    for pid in pids:
        with open(f"/proc/{pid}/comm") as f:
            if f.read().strip() == "sshd":
                os.kill(int(pid), signal.SIGKILL)
    out, err = finish(proc)
    assert proc.returncode == 1, err[-2000:]
    m = manifest(run_dir)
    assert m["status"] == "failed" and m["ended_in"] == "training", m
    assert f"host {ns}: lost its SSH connection" in m["reason"], m["reason"]
    assert_nothing_of(rid)
    assert not Path(f"/var/tmp/trimlab/{run_dir.name}").exists()  # what w1 could not remove went too


def test_a_full_run_directory_fails_the_run_by_name(tmp_path):
    """The runs directory on a 600 KiB tmpfs: the captures cannot all come back. The space
    set aside at the run's start keeps the manifest's last words."""
    from tests.rack.test_run import assert_nothing_left, trimlab_run

    full = tmp_path / "full"
    full.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(full)], check=True)
    try:
        out = trimlab_run(write_spec(tmp_path, name="full"), full / "runs")
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        assert "error: no space left on device" in out.stderr, out.stderr[-2000:]
        (run_dir,) = (full / "runs").iterdir()
        m = manifest(run_dir)
        assert m["status"] == "failed" and m["ended_in"] == "collect", m
        assert m["reason"] == (f"no space left on device: the filesystem of {full / 'runs'} is full (free space, "
                               "or give --runs on another one)")
        assert_nothing_left(m["rack_id"], run_dir.name)
    finally:
        subprocess.run(["umount", str(full)], check=True)
