import datetime as dt
import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from trimlab.rundir import RunDir
from trimlab.spec import ExperimentSpec, validated


def spec(**kw):
    return validated(ExperimentSpec, {"name": "demo", "seed": 5, **kw})


def manifest(run):
    return json.loads((run.path / "manifest.json").read_text())


def test_a_run_is_running_then_succeeded(tmp_path):
    with RunDir.create(tmp_path, spec()) as run:
        m = manifest(run)
        assert m["status"] == "running" and m["reason"] is None and m["finished"] is None
        assert m["spec"]["name"] == "demo" and m["seeds"] == {"seed": 5, "job": 1}
        assert m["versions"]["torch"].startswith("2.") and "trimlab" in m["versions"]
        assert {p.name for p in run.path.iterdir()} >= {"logs", "pcaps", "switch", "truth", "manifest.json"}
        run.record(inventory="/var/lib/trimlab/racks/0/inventory.yml", hosts={"w1": {"role": "worker"}})
        assert manifest(run)["hosts"] == {"w1": {"role": "worker"}}
        run.record(phases_s={"training": 1.5})  # a field of its own kind is kept as it is
        assert manifest(run)["phases_s"] == {"training": 1.5}
    m = manifest(run)
    assert m["status"] == "succeeded" and m["finished"]
    assert run.path.name.endswith("-demo") and run.path.name[:8].isdigit()


def test_a_failed_run_keeps_what_it_collected_and_says_why(tmp_path):
    with pytest.raises(RuntimeError):
        with RunDir.create(tmp_path, spec()) as run:
            (run.path / "logs" / "w1.log").write_text("step 1\n")
            raise RuntimeError("worker w2 exited 1")
    m = manifest(run)
    assert m["status"] == "failed" and m["reason"] == "RuntimeError: worker w2 exited 1"
    assert (run.path / "logs" / "w1.log").read_text() == "step 1\n"


def test_interrupt_is_recorded(tmp_path):
    with pytest.raises(KeyboardInterrupt):
        with RunDir.create(tmp_path, spec()) as run:
            raise KeyboardInterrupt
    assert manifest(run)["status"] == "interrupted"
    assert manifest(run)["reason"] == "interrupted by SIGINT (Ctrl-C)"


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_stop_signal_ends_a_run_as_interrupted_in_its_phase(tmp_path, sig):
    """The first signal unwinds; a second one during the clean-up is ignored, so the
    clean-up (here: a `finally` that signals again, then writes a file) completes."""
    code = f"""
import os, signal, time
from trimlab.rundir import RunDir, stop_signals_as_interrupt
from trimlab.spec import ExperimentSpec, validated
stop_signals_as_interrupt()
try:
    with RunDir.create(__import__('pathlib').Path({str(tmp_path)!r}), validated(ExperimentSpec, {{'name': 'x'}})) as r:
        r.enter_phase("training")
        os.kill(os.getpid(), signal.{sig})
        time.sleep(60)
finally:
    os.kill(os.getpid(), signal.SIGTERM)
    open({str(tmp_path / "cleaned")!r}, "w").close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and (tmp_path / "cleaned").exists(), out.stderr
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    m = json.loads((run / "manifest.json").read_text())
    name = "SIGINT (Ctrl-C)" if sig == "SIGINT" else sig
    assert m["status"] == "interrupted" and m["reason"] == f"interrupted by {name} during training"


def test_a_clean_up_that_overruns_its_grace_is_cut_short_by_the_last_resorts(tmp_path):
    """The bound on a stop: a clean-up that hangs (here: a `finally` that waits forever)
    is cut short once the grace has passed; the registered last resorts still run (a rack
    taken down, the manifest marked) and the process exits 128 + signum."""
    code = f"""
import os, signal, threading
from trimlab import rundir
from trimlab.rundir import RunDir, stop_signals_as_interrupt
from trimlab.spec import ExperimentSpec, validated
stop_signals_as_interrupt()
rundir.on_overdue_stop("rack x", lambda: open({str(tmp_path / "rack-down")!r}, "w").close())
with RunDir.create(__import__('pathlib').Path({str(tmp_path)!r}), validated(ExperimentSpec, {{'name': 'x'}})) as r:
    r.enter_phase("training")
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    finally:
        threading.Event().wait()  # a clean-up step that never returns
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=os.environ | {"TRIMLAB_STOP_GRACE_S": "0.5"})
    assert out.returncode == 128 + signal.SIGTERM, out.stderr
    assert "clean-up after SIGTERM took over 0.5 s" in out.stderr
    assert (tmp_path / "rack-down").exists()
    (run,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    m = json.loads((run / "manifest.json").read_text())
    assert m["status"] == "interrupted"
    assert m["reason"] == "interrupted by SIGTERM during training; its clean-up overran 0.5 s and was cut short"


def _stopped_inside(tmp_path, body: str) -> subprocess.CompletedProcess:
    """Run `body` in a process whose stop signals raise Interrupted; it prints what it saw."""
    code = f"""
import os, signal, subprocess, sys
from pathlib import Path
from trimlab import rundir
rundir.stop_signals_as_interrupt()
tmp = Path({str(tmp_path)!r})
try:
{textwrap.indent(textwrap.dedent(body), "    ")}
except rundir.Interrupted as exc:
    print("interrupted", signal.Signals(exc.signum).name)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_a_stop_inside_a_rack_command_waits_for_it_and_then_unwinds(tmp_path):
    """The race CI met: a stop while `ip netns add` ran cut the command, which went on to
    create its namespace after the clean-up had looked. Here the command signals its parent
    and then makes its state (after longer than the quarter second subprocess gives an
    interrupted child): the state exists before the stop is raised."""
    out = _stopped_inside(tmp_path, """
        from trimlab.testbed.vrack import rack
        rack._run("sh", "-c", f"kill -HUP $PPID; sleep 1; touch {tmp}/made")
        print("not reached")
    """)
    assert out.stdout.split("\n")[0] == "interrupted SIGHUP", out.stderr
    assert (tmp_path / "made").exists()


def test_a_stop_while_a_process_starts_still_leaves_its_handle_to_the_caller(tmp_path):
    """A stop that arrives inside Popen (here: the child signals its parent before exec)
    would leave the child running with no handle to stop it; spawn puts it in the
    caller's list first."""
    out = _stopped_inside(tmp_path, """
        procs = []
        try:
            rundir.spawn(procs, ["sleep", "60"], preexec_fn=lambda: os.kill(os.getppid(), signal.SIGTERM))
            print("not reached")
        finally:
            print("handles", len(procs))
            for p in procs:
                p.kill()
                p.wait()
    """)
    assert out.stdout.split() == ["handles", "1", "interrupted", "SIGTERM"], out.stderr


def test_two_runs_in_the_same_second_get_their_own_directories(tmp_path):
    now = dt.datetime(2026, 12, 2, 18, 0, 0, tzinfo=dt.timezone.utc)
    a = RunDir.create(tmp_path, spec(), now=now)
    b = RunDir.create(tmp_path, spec(), now=now)
    assert a.path != b.path and b.path.name == "20261202T180000Z-demo-2"


def test_a_running_run_whose_owner_is_gone_shows_as_died():
    from trimlab import rundir

    def shown(status, owner=None):
        return rundir.Manifest(schema_version=1, name="r", status=status, started="", owner=owner).shown_status()

    me = rundir.owner()
    assert rundir.owner_alive(me)
    assert shown("running", me) == "running"
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    gone = rundir.owner(child.pid)
    child.wait()  # reaped: the PID names no process
    assert not rundir.owner_alive(gone)
    assert shown("running", gone) == "died"
    assert not rundir.owner_alive(me | {"start": me["start"] + 1})  # a reused PID is another process
    assert not rundir.owner_alive(me | {"boot_id": "another boot"})
    assert shown("interrupted", gone) == "interrupted"
    assert shown("running") == "running"  # an old manifest: unknown owner


def test_a_run_summary_says_when_no_port_was_congested():
    from trimlab.testbed.orchestrator import progress
    base = {"wall_s": 1.0, "test_acc": 0.9, "parameters_identical": True, "ps": {}}
    calm = progress.summary("p", base | {"switch": {"TRIM_PKTS": 0, "DROP_PKTS": 0}}, "runs/p")
    assert "no congestion: no port trimmed or dropped" in calm
    busy = progress.summary("p", base | {"switch": {"TRIM_PKTS": 5, "DROP_PKTS": 0}}, "runs/p")
    assert "no congestion" not in busy and "switch trims 5" in busy
    flows = {"0": {"requested_bps": 19e6, "offered_bps": 10.9e6, "ratio": 0.5737, "on_s": 2.0},
             "1": {"requested_bps": 19e6, "offered_bps": 18.8e6, "ratio": 0.9895, "on_s": 2.0}}
    said = progress.summary("p", base | {"switch": {"TRIM_PKTS": 5}, "background": flows}, "runs/p")
    assert "flow 0 offered 10.9 of 19.0 Mbit/s (57%): the load fell short" in said and "flow 1" not in said
    assert "time limit" not in said
    limited = progress.summary("p", base | {"steps": 400, "steps_done": 120, "time_limit": True}, "runs/p")
    assert "stopped at its time limit after 120 of 400 steps" in limited
