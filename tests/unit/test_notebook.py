"""The notebook API over synthetic run directories: trimlab.load_run / compare / list_runs
and `trimlab runs`."""

import json
import subprocess
import sys
from pathlib import Path

import plotly.graph_objects as go
import pytest

import trimlab
from tests.unit.synthrun import Synth
from trimlab import rundir
from trimlab.analysis.notebook import Comparison, Run, Sweep
from trimlab.analysis.rundata import RunDataError

TRIMLAB = str(Path(sys.executable).with_name("trimlab"))


def stamp(run: Path, started: str, name: str) -> Path:
    m = json.loads((run / rundir.MANIFEST).read_text())
    m |= {"started": started, "name": name}
    m["results"] |= {"switch": {"TRIM_PKTS": 2, "DROP_PKTS": 1}}
    (run / rundir.MANIFEST).write_text(json.dumps(m))
    return run


@pytest.fixture
def runs(tmp_path):
    root = tmp_path / "runs"
    a = stamp(Synth(trims={(0, 0, 0, 1): 60}, drops={(1, 0, 0, 2)}).write(root / "a"), "2026-12-01T10:00:00+00:00", "a")
    sweep = root / "sw"
    b = stamp(Synth(drops={(0, 1, 0, 0)}).write(sweep / "p1"), "2026-12-02T10:00:00+00:00", "p1")
    (sweep / rundir.SWEEP_POINTS).write_text('["p1"]')
    return root, a, sweep, b


def test_load_run_shows_summary_packets_checks_and_figures(runs):
    _, a, _, _ = runs
    run = trimlab.load_run(a)
    assert isinstance(run, Run) and run.manifest["name"] == "a"
    assert run.summary["trimmed"] == 1 and run.summary["dropped"] == 1
    assert len(run.packets) == run.summary["sent"] and {"trimmed", "nmse", "dropped"} <= set(run.packets)
    assert set(run.checks["status"]) == {"agree"}
    assert set(run.figures) == {"congestion", "training", "phases", "error_by_bits", "error_by_step"}
    assert all(isinstance(f, go.Figure) for f in run.figures.values())
    assert "<table>" in run._repr_html_() and "final accuracy" in repr(run)


def test_sweeps_and_comparisons(runs):
    _, a, sweep, _ = runs
    sw = trimlab.load_run(sweep)
    assert isinstance(sw, Sweep) and [r.manifest["name"] for r in sw.runs] == ["p1"]
    cmp = trimlab.compare([trimlab.load_run(a), sw])
    assert isinstance(cmp, Comparison) and list(cmp.table["run"]) == ["a", "p1"]
    assert set(cmp.figures) == {"accuracy_vs_trim_rate", "training"} and "<table" in cmp._repr_html_()
    assert list(trimlab.compare([a, sweep]).table["run"]) == ["a", "p1"]  # paths too


def test_list_runs_newest_first_and_the_command(runs):
    root, a, _, b = runs
    df = trimlab.list_runs(root)
    assert list(df["name"]) == ["p1", "a"] and list(df["sweep"].fillna("")) == ["sw", ""]
    assert list(df["trims"]) == [2, 2] and df["accuracy"].notna().all()
    out = subprocess.run([TRIMLAB, "runs", str(root), "--json"], capture_output=True, text=True, check=True)
    assert [r["name"] for r in json.loads(out.stdout)] == ["p1", "a"]
    out = subprocess.run([TRIMLAB, "runs", str(root)], capture_output=True, text=True, check=True).stdout
    assert out.index("p1") < out.index(str(a)) and "succeeded" in out
    with pytest.raises(RunDataError, match="no such directory"):
        trimlab.list_runs(root / "nope")
    with pytest.raises(AttributeError):
        trimlab.nothing_here  # noqa: B018
