"""Run directories from Python, for notebooks: objects that show themselves (a summary
table in Jupyter, Plotly figures that render inline) over the same analysis the reports use.

    import trimlab
    run = trimlab.load_run("runs/20261204T010203Z-default")
    run                      # summary table
    run.packets              # one row per gradient packet, matched across observers
    run.checks               # the observers' checks
    run.figures["error_by_bits"]
    cmp = trimlab.compare(["runs/a", "runs/sweep-b"])
    cmp.table, cmp.figures["accuracy_vs_trim_rate"]
    trimlab.list_runs("runs")  # newest first
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import pandas as pd

from trimlab import rundir
from trimlab.analysis import figures, report
from trimlab.analysis.rundata import RunData, RunDataError


def _html_table(d: dict) -> str:
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th><td>{html.escape(report.fmt(v))}"
                   f"</td></tr>" for k, v in d.items() if v is not None)
    return f"<table>{rows}</table>"


class Run:
    """One run directory: manifest, packet table, checks and figures, loaded on first use."""

    def __init__(self, path: str | Path):
        self.data = RunData.open(path)
        self.path = self.data.path

    def __repr__(self) -> str:
        s = self.summary
        return (f"<trimlab run {s['run']}: {s['status']}, codec {s['codec']}, final accuracy "
                f"{report.fmt(s.get('final_acc'))}, {s.get('trimmed', '?')} trimmed, {s.get('dropped', '?')} dropped>")

    def _repr_html_(self) -> str:
        return f"<b>trimlab run {html.escape(str(self.summary['run']))}</b>" + _html_table(self.summary)

    @property
    def manifest(self) -> dict:
        return self.data.manifest.model_dump(mode="json")

    @property
    def spec(self) -> dict:
        return self.data.spec

    @cached_property
    def packets(self) -> pd.DataFrame | None:
        """packets.parquet (matched and checked now if the run has none yet); None where the
        run left nothing to match."""
        return report.packet_rows(self.data)

    @cached_property
    def checks(self) -> pd.DataFrame:
        if not (self.path / rundir.CHECKS).exists():
            self.packets  # noqa: B018  (matching writes checks.json)
        p = self.path / rundir.CHECKS
        return pd.DataFrame(json.loads(p.read_text())["checks"] if p.exists() else [])

    @cached_property
    def summary(self) -> dict:
        return report.summary(self.data, self.packets)

    @property
    def metrics(self) -> pd.DataFrame:
        return self.data.metrics

    @property
    def steps(self) -> pd.DataFrame:
        return self.data.steps

    @cached_property
    def figures(self) -> dict:
        """The report's figures (plotly go.Figure), by name."""
        run = self.data
        out = {"congestion": figures.congestion(run.occupancy, run.traffic_events),
               "training": figures.training(run.metrics, run.steps), "phases": figures.phases(run.metrics)}
        if self.packets is not None:
            out["error_by_bits"] = figures.error_by_bits(self.packets, report.theory_curve(run.codec, run.cfg.codec.coords))
            out["error_by_step"] = figures.error_by_step(self.packets)
        return out


@dataclass
class Comparison:
    """Several runs (a sweep's points, seeds, contenders) side by side."""

    table: pd.DataFrame  # one row per run: summary, time and steps to the target accuracy
    curves: dict[str, pd.DataFrame]

    @cached_property
    def figures(self) -> dict:
        return {"accuracy_vs_trim_rate": figures.accuracy_vs_trim_rate(self.table.dropna(subset=["affected_rate"])),
                "training": figures.training_overlay(self.curves)}

    def _repr_html_(self) -> str:
        cols = ["run", "status", "codec", "action", "inject_p", "load", "achieved", "peak_occupancy", "trimmed_rate",
                "dropped_rate", "final_acc", "steps_to_target", "seconds_to_target", "wall_s"]
        return self.table[[c for c in cols if c in self.table]].to_html(index=False)


class Sweep(Comparison):
    """A sweep directory: its points as `Run`s, compared."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.runs = [Run(p) for p in report.expand([self.path])]
        table, curves = report.results([self.path])
        super().__init__(table, curves)

    def __repr__(self) -> str:
        return f"<trimlab sweep {self.path.name}: {len(self.runs)} points>"


def load_run(path: str | Path) -> Run | Sweep:
    """A run directory as a `Run`, or a sweep directory as a `Sweep` of its points."""
    path = Path(path)
    if (path / rundir.SWEEP_POINTS).exists():
        return Sweep(path)
    return Run(path)


def compare(runs) -> Comparison:
    """Runs (paths, `Run`s or `Sweep`s; a sweep stands for its points) in one table."""
    runs = [runs] if isinstance(runs, (str, Path, Run, Sweep)) else runs
    paths = [getattr(r, "path", r) for r in runs]
    table, curves = report.results(paths)
    return Comparison(table, curves)


def list_runs(root: str | Path = "runs") -> pd.DataFrame:
    """Every run directory under `root` (sweeps' points included), newest first: name,
    start time, status, final accuracy, trims and drops the switch counted, wall time."""
    root = Path(root)
    if not root.is_dir():
        raise RunDataError(f"{root}: no such directory; give the directory `trimlab run --runs` wrote to")
    rows = []
    for m_path in root.rglob(rundir.MANIFEST):
        try:
            m = rundir.Manifest.read(m_path.parent)
        except (OSError, ValueError):
            continue  # a manifest being written, or not ours
        res = m.results
        sw = res.get("switch") or {}
        sweep = m_path.parent.parent
        rows.append({"name": m.name, "started": m.started, "status": m.shown_status(), "accuracy": res.get("test_acc"),
                     "trims": sw.get("TRIM_PKTS"), "drops": sw.get("DROP_PKTS"), "wall_s": res.get("wall_s"),
                     "sweep": sweep.name if (sweep / rundir.SWEEP_POINTS).exists() else None,
                     "path": str(m_path.parent)})
    cols = ["name", "started", "status", "accuracy", "trims", "drops", "wall_s", "sweep", "path"]
    df = pd.DataFrame(rows, columns=cols)
    df["started"] = pd.to_datetime(df["started"], utc=True, errors="coerce")
    return df.sort_values("started", ascending=False, na_position="last", kind="stable").reset_index(drop=True)


__all__ = ["Comparison", "Run", "Sweep", "compare", "list_runs", "load_run"]
