"""`trimlab run` end to end on virtual racks: training through the eBPF switch with trims
seen by the switch counters and by the ps log, identical parameters on every host, a
killed worker failing the run with its artifacts kept, and nothing left behind."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.rack.conftest import require_root
from tests.wireshark_check import assert_dissector_matches

ROOT = Path(__file__).resolve().parents[2]
TRIMLAB = str(Path(sys.executable).with_name("trimlab"))

SPEC = {
    "name": "t2", "seed": 5, "topology": "ps",
    "rack": {"virtual": {"workers": 2, "traffic_hosts": 0, "rate": "100mbit", "buffer_bytes": 4096}},
    "workload": {"kind": "digits", "model": "mlp", "steps": 20, "batch": 32, "lr": 0.1, "momentum": 0.9},
    "codec": {"name": "embedded", "params": {"planes": 16}, "coords": 480},
    "transport": {"deadline_ms": 300},
    "capture": {"points": ["workers", "ps"]},
    "truth": {"every": 5},
}


def write_spec(tmp: Path, **changes) -> Path:
    spec = json.loads(json.dumps(SPEC))
    spec.update(changes)
    path = tmp / f"{spec['name']}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def trimlab_run(spec: Path, runs: Path, *extra: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return subprocess.run([TRIMLAB, "run", str(spec), "--runs", str(runs), *extra], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def manifest(run_dir: Path) -> dict:
    return json.loads((run_dir / "manifest.json").read_text())


def assert_nothing_left(rack_id: str, run_name: str) -> None:
    nss = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert f"tl{rack_id}-" not in nss
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"tl{rack_id}-" not in links
    assert not Path(f"/sys/fs/bpf/tl{rack_id}").exists()
    assert not Path(f"/var/tmp/trimlab/{run_name}").exists()
    from trimlab.testbed.vrack.rack import racks_dir
    assert not (racks_dir() / rack_id).exists()


@pytest.fixture(autouse=True)
def _root():
    require_root()


def ps_trims(run_dir: Path) -> int:
    with open(run_dir / "agents" / next(p.name for p in (run_dir / "agents").iterdir()
                                        if p.name.endswith("-ps1")) / "packets.csv") as f:
        return sum(int(r["trimmed"]) for r in csv.DictReader(f) if r["status"] == "accepted")


def test_sweep_over_topologies_trains_through_trims_with_identical_parameters(tmp_path):
    spec = write_spec(tmp_path, sweep={"topology": ["ps", "sharded"]})
    out = trimlab_run(spec, tmp_path / "runs")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sweep_dir = next((tmp_path / "runs").iterdir())
    points = json.loads((sweep_dir / "sweep.json").read_text())
    assert len(points) == 2
    runs = {manifest(d)["spec"]["topology"]: d for d in sweep_dir.iterdir() if (d / "manifest.json").exists()
            and d != sweep_dir and manifest(d)["name"] in points}
    for topology, d in runs.items():
        m = manifest(d)
        assert m["status"] == "succeeded", m["reason"]
        r = m["results"]
        assert r["parameters_identical"] and len(r["workers"]) == 2
        assert r["test_acc"] > 0.5  # 20 steps of digits
        assert (d / "inventory.yml").exists() and (d / "agent.json").exists()
        assert sorted(p.name for p in (d / "pcaps").iterdir())[:1]  # captures collected
        assert any((d / "truth").iterdir())
        assert_nothing_left(m["rack_id"], d.name)
        # the analysis: every observer of every trim agrees, and the report is written
        checks = json.loads((d / "checks.json").read_text())
        assert checks["all_agree"], [c for c in checks["checks"] if c["status"] != "agree"]
        page = (d / "report.html").read_text()
        assert page.count('<tr class="agree">') == len(checks["checks"]) and 'id="fig-error-bits"' in page
        rows = pd.read_parquet(d / "packets.parquet")
        assert rows["step"].nunique() == 20 and rows.groupby(["step", "rank"]).size().nunique() == 1
        assert rows["seen_sender"].all() and not rows["dropped"].any()
        assert rows.loc[rows["nmse"].notna(), "step"].isin([0, 5, 10, 15]).all()
    ps = manifest(runs["ps"])["results"]
    # the 2:1 incast into a 4 KiB queue trims; switch, ps log and ps summary agree
    assert ps["switch"]["TRIM_PKTS"] > 0
    assert ps["ps"]["trimmed"] == ps["switch"]["TRIM_TX_PKTS"] == ps_trims(runs["ps"])
    trimmed = pd.read_parquet(runs["ps"] / "packets.parquet")["trimmed"].sum()
    assert trimmed == ps["switch"]["TRIM_TX_PKTS"]
    assert 'id="fig-acc-trim-rate"' in (sweep_dir / "report.html").read_text()  # the sweep's comparison
    pcaps = sorted(p.name for p in (runs["ps"] / "pcaps").iterdir())
    assert any(n.startswith("tl") and "ps1" in n for n in pcaps)
    # the Wireshark dissector reads the ps's capture as analysis.pcap does, trims included
    ps_pcap = next(p for p in (runs["ps"] / "pcaps").iterdir() if "ps1" in p.name and p.suffix == ".pcap")
    assert assert_dissector_matches(ps_pcap) > 0
    assert (runs["ps"] / "switch" / "occupancy.csv").stat().st_size > 0


def test_run_twice_in_a_row(tmp_path):
    spec = write_spec(tmp_path, name="twice", workload={**SPEC["workload"], "steps": 5})
    for _ in range(2):
        out = trimlab_run(spec, tmp_path / "runs")
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    dirs = sorted((tmp_path / "runs").iterdir())
    assert len(dirs) == 2 and all(manifest(d)["status"] == "succeeded" for d in dirs)


def test_the_hooks_pacing_is_held_by_the_kernel_and_measured_in_the_run(tmp_path):
    """Workers that do not send at once (no incast) pace to 90 % of the ps's port between
    them; on a virtual rack an htb class of their own paces them, and each worker's
    capture measures the rate its packets left at against the request: the check agrees
    exactly when the measured rate is within 3 % (on a host whose cores the run saturates,
    the kernel's own dequeues run late, and the check says so)."""
    spec = write_spec(tmp_path, name="paced", workload={**SPEC["workload"], "steps": 10},
                      congestion={"incast": False})
    out = trimlab_run(spec, tmp_path / "runs")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    checks = {c["check"]: c for c in json.loads((run_dir / "checks.json").read_text())["checks"]}
    for w in ("w1", "w2"):
        (paced,) = [c for n, c in checks.items() if n.startswith("hook pacing = requested") and n.endswith(f"-{w})")]
        assert paced["expected"] == 45.0 and 0 < paced["observed"], paced
        assert (paced["status"] == "agree") == (paced["observed"] >= 0.97 * 45.0), paced
        (log,) = run_dir.glob(f"logs/*-{w}-worker.log")
        (event,) = [json.loads(line) for line in log.read_text().splitlines() if '"pacing"' in line]
        assert event["paced_by"] == "htb 1:100", event


def test_killed_worker_fails_the_run_with_artifacts_kept(tmp_path):
    spec = write_spec(tmp_path, name="kill", workload={**SPEC["workload"], "steps": 2000})
    runs = tmp_path / "runs"
    proc = subprocess.Popen([TRIMLAB, "run", str(spec), "--runs", str(runs)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        log = None
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:  # wait until w2 trains
            logs = list(runs.glob("*/logs/*-w2-worker.log"))
            if logs and '"step":5' in logs[0].read_text().replace(" ", ""):
                log = logs[0]
                break
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.5)
        assert log is not None, "the worker never reached step 5"
        run_dir = log.parent.parent
        rack_id = manifest(run_dir)["rack_id"]
        pids = subprocess.run(["ip", "netns", "pids", f"tl{rack_id}-w2"], capture_output=True,
                              text=True).stdout.split()
        victims = [int(p) for p in pids if "agents.worker" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")]
        assert victims
        killed_at = time.monotonic()
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=120)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    assert proc.returncode == 1, out[-2000:] + err[-2000:]
    assert took < 60  # stopped, collected and taken down well within a minute
    m = manifest(run_dir)
    assert m["status"] == "failed" and "w2" in m["reason"], m["reason"]
    assert (run_dir / "agents").exists() and any((run_dir / "pcaps").iterdir())
    assert (run_dir / "logs" / log.name).exists()
    assert_nothing_left(rack_id, run_dir.name)


def test_background_load_is_measured_and_a_starved_flow_is_named(tmp_path):
    """Two background flows into the ps's port while two workers train: the one left alone
    offers its rate (within the check's 3 %); the other is starved on purpose (its sender
    stopped with SIGSTOP for half of the training, then resumed), and the check, the
    manifest and the run's summary line all say by how much it fell short, while the switch's
    port counted what both senders sent."""
    spec = write_spec(tmp_path, name="load", rack={"virtual": {**SPEC["rack"]["virtual"], "traffic_hosts": 1}},
                      workload={**SPEC["workload"], "steps": 40},
                      congestion={"incast": True, "background": [{"rate": "20mbit"}, {"rate": "20mbit"}]})
    runs = tmp_path / "runs"
    proc = subprocess.Popen([TRIMLAB, "run", str(spec), "--runs", str(runs)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped = []
    try:
        def worker_step():
            logs = list(runs.glob("*/logs/*-w1-worker.log"))
            steps = re.findall(r'"step": ?(\d+)', logs[0].read_text()) if logs else []
            return int(steps[-1]) if steps else -1

        def sender1():  # flow 1's sender (and any wrapper around it: stopping those is harmless)
            found = []
            for rack_dir in runs.glob("*"):
                try:
                    rid = manifest(rack_dir)["rack_id"]
                except (OSError, ValueError, KeyError):
                    continue
                pids = subprocess.run(["ip", "netns", "pids", f"tl{rid}-tr1"], capture_output=True,
                                      text=True).stdout.split()
                for pid in pids:
                    cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if Path(f"/proc/{pid}").exists() else []
                    if b"send" in cmd and b"--port" in cmd and cmd[cmd.index(b"--port") + 1].endswith(b"1"):
                        found.append(int(pid))
            return found or None

        deadline = time.monotonic() + 300
        while (worker_step() < 3 or sender1() is None) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        pids, at = sender1(), worker_step()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        while worker_step() < at + 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        stopped.clear()
        out, err = proc.communicate(timeout=400)
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    (run_dir,) = [d for d in runs.iterdir() if (d / "manifest.json").exists()]
    bg = manifest(run_dir)["results"]["background"]
    assert bg["0"]["ratio"] >= 0.97 and bg["1"]["ratio"] < 0.97, bg
    checks = {c["check"]: c for c in json.loads((run_dir / "checks.json").read_text())["checks"]}
    assert checks["offered load = requested (flow 0)"]["status"] == "agree"
    short = checks["offered load = requested (flow 1)"]
    assert short["status"] == "disagree" and short["detail"].startswith("flow 1 offered "), short
    assert re.search(r"flow 1 offered [\d.]+ of 20\.0 Mbit/s \(\d+%\): the load fell short", out), out[-2000:]
    # the switch's port is the second observer: it received what both senders handed their kernel
    (sw,) = [c for n, c in checks.items() if n.startswith("background bytes = switch port in")]
    assert sw["status"] == "agree", sw
    assert all(f["received_bps"] > 0 for f in bg.values()), bg  # and the sink, the third
    assert_nothing_left(manifest(run_dir)["rack_id"], run_dir.name)
