"""DDP through the trimming switch: `trimlab run` launches the example DDP script on four
workers of a virtual rack; with the hook, every rank ends with identical parameters, with
and without injected trims, and the analysis sees every trim from all three observers.
`trimlab bench ddp --quick` compares it with gloo all-reduce on the same rack."""

import json
import subprocess
import sys

import pandas as pd
import pytest

from trimlab.config import PHASES

from tests.rack.conftest import require_root
from tests.rack.test_run import (
    ROOT,
    assert_nothing_left,
    manifest,
    trimlab_run,
    write_spec,
)


@pytest.fixture(autouse=True)
def _root():
    require_root()


def test_ddp_script_trains_through_trims_with_identical_parameters(tmp_path):
    """The hook with and without injected trims, and the stock path (DDP's gloo all-reduce,
    TCP through the same switch) as a point of the same sweep, its packets matched by the
    switch's counters and both ends' captures."""
    spec = write_spec(tmp_path, name="ddp", topology="sharded", seed=3,
                      rack={"virtual": {"workers": 4, "traffic_hosts": 0, "rate": "100mbit", "buffer_bytes": 4000000}},
                      workload={"kind": "ddp", "steps": 30, "batch": 64, "lr": 0.1},
                      codec={"name": "embedded", "params": {"planes": 16}, "coords": 480},
                      transport={"deadline_ms": 500}, capture={"points": ["workers"]}, truth={"every": 10},
                      sweep={"congestion.inject_probability": [0.0, 0.3]},
                      extra_points=[{"workload.comm": "gloo"}])
    out = trimlab_run(spec, tmp_path / "runs", timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    sweep = next((tmp_path / "runs").iterdir())
    runs = {(manifest(d)["spec"]["workload"]["comm"], manifest(d)["spec"]["congestion"]["inject_probability"]): d
            for d in sweep.iterdir() if d.is_dir() and (d / "manifest.json").exists()}
    assert sorted(runs) == [("gloo", 0.0), ("trimlab", 0.0), ("trimlab", 0.3)]
    for p, d in runs.items():
        m = manifest(d)
        assert m["status"] == "succeeded", m["reason"]
        r = m["results"]
        assert r["parameters_identical"] and len(r["workers"]) == 4  # the hooks' gradient checksums
        assert r["test_acc"] > 0.8  # 30 steps of digits, trimmed or not
        checks = json.loads((d / "checks.json").read_text())
        assert checks["all_agree"], [c for c in checks["checks"] if c["status"] != "agree"]
        assert_nothing_left(m["rack_id"], d.name)
    clean, trimmed = manifest(runs["trimlab", 0.0])["results"], manifest(runs["trimlab", 0.3])["results"]
    assert clean["switch"]["TRIM_PKTS"] == 0 and trimmed["switch"]["TRIM_PKTS"] > 0
    rows = pd.read_parquet(runs["trimlab", 0.3] / "packets.parquet")
    assert 0.2 < rows["trimmed"].mean() < 0.4 and rows["receiver"].nunique() == 4
    gloo = manifest(runs["gloo", 0.0])["results"]
    assert gloo["switch"]["TX_PKTS"] > 1000  # gloo's TCP crossed the switch
    checks = {c["check"]: c for c in json.loads((runs["gloo", 0.0] / "checks.json").read_text())["checks"]}
    assert checks["gloo sent = received + dropped"]["expected"] > 1000
    assert 'id="fig-acc-trim-rate"' in (sweep / "report.html").read_text()


def test_bench_ddp_quick():
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "bench", "ddp", "--json", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout)
    at = r["rates"]["100mbit"]
    assert set(at["models"]) == {"5k", "1M"} and at["models"]["1M"]["parameters"] > 1e6
    for m in at["models"].values():
        assert m["compute_floor_ms"] > 0 and m["wire_bound_ms"]["hook"] > 0 and m["wire_bound_ms"]["allreduce"] > 0
        for key in ("no_congestion", "with_congestion"):
            assert m[key]["hook_step_ms"] > 0 and m[key]["allreduce_step_ms"] > 0 and m[key]["hook_over_allreduce"] > 0
            assert set(m[key]["hook_phases_ms"]) == set(PHASES)
            # the ranks' CPU over the host's cores in their steps (each rank's threads, their
            # sends' kernel work included): a share, measured per contender
            assert all(v > 0 for v in m[key]["cpu_share"].values()), m[key]["cpu_share"]
    # nothing trimmed (the small model never fills a port): all-reduce's result up to the
    # codec's untrimmed error; the 1 M model's own incast is trimmed even without a flow
    assert at["models"]["5k"]["no_congestion"]["params_rel_diff"] < 1e-4
    assert at["models"]["1M"]["no_congestion"]["params_rel_diff"] < 0.05
    assert set(r["targets"]) == {"hook_le_allreduce_from_1M", "hook_le_half_allreduce_congested_from_1M",
                                 "hook_within_2x_wire_bound_at_1gbit"}
    assert_nothing_left("bdd", "none")
