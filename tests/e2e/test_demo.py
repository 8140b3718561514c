"""`make demo`: the default experiment on a fresh virtual rack, end to end, with every
observer of every trim agreeing."""

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_make_demo_runs_the_default_experiment_with_trims(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")
    out = subprocess.run(["make", "-C", str(ROOT), "demo", f"RUNS={tmp_path / 'runs'}"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    m = json.loads((run_dir / "manifest.json").read_text())
    assert m["status"] == "succeeded" and m["name"] == "default"
    r = m["results"]
    assert r["switch"]["TRIM_PKTS"] > 0 and r["ps"]["trimmed"] > 0
    assert r["parameters_identical"] and r["test_acc"] > 0.8
    assert "run default succeeded" in out.stdout
    # the demo rehearses what a lab sees: a switch that leaves trimmed packets' lengths
    # stale, the hosts' receive repair, and every observer agreeing on every trim
    assert [p["name"] for p in m["platforms"].values()] == ["sonic"]
    checks = json.loads((run_dir / "checks.json").read_text())
    assert checks["all_agree"], [c for c in checks["checks"] if c["status"] != "agree"]
    (rep,) = [c for c in checks["checks"] if c["check"].startswith("capture trims = repaired")]
    assert rep["observed"] == rep["expected"] > 0
