"""Reports: one self-contained HTML page per run, and a comparison page for several runs
or a sweep. plotly.js is inlined once, every figure has a fixed div id, and nothing is
fetched from the network: the page opens offline from a file:// URL.

    for_run(run_dir)                       # packets.parquet, checks.json, report.html
    compare([run_or_sweep, ...], out)      # one page comparing the runs
"""

from __future__ import annotations

import html
import json
from pathlib import Path

import pandas as pd
import plotly.io as pio
import torch
from plotly.offline import get_plotlyjs

from trimlab import rundir
from trimlab.analysis import figures, match
from trimlab.analysis.rundata import RunData, RunDataError
from trimlab.errors import TrimlabError
from trimlab.spec import CodecSpec, CongestionSpec

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{font-size:1.5em} h2{font-size:1.15em;margin-top:2em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.9em} td,th{padding:.25em .7em;border-bottom:1px solid #eee;text-align:left}
th{background:#f5f5f5} .agree{background:#d9f2d9} .explained{background:#fff1c2} .disagree{background:#f8d0d0}
.n\\/a{background:#eee} .muted{color:#777;font-size:.85em} code{background:#f4f4f4;padding:0 .2em}
.succeeded{color:#1a7f1a;font-weight:bold} .failed,.running{color:#b00;font-weight:bold}
"""


def _plotly_js() -> str:
    return get_plotlyjs()


def _figure(fig, div_id: str) -> str:
    return pio.to_html(fig, full_html=False, include_plotlyjs=False, div_id=div_id,
                       config={"displaylogo": False, "responsive": True})


def _table(rows: list[dict], table_id: str | None = None, status_key: str | None = None) -> str:
    if not rows:
        return "<p class=muted>none</p>"
    keys = list(rows[0])
    head = "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
    body = []
    for r in rows:
        row_cls = f' class="{html.escape(str(r[status_key]))}"' if status_key else ""
        body.append(f"<tr{row_cls}>" + "".join(f"<td>{html.escape(fmt(r[k]))}</td>" for k in keys) + "</tr>")
    attr = f' id="{table_id}"' if table_id else ""
    return f'<table{attr}><tr>{head}</tr>{"".join(body)}</table>'


def fmt(v) -> str:
    if isinstance(v, float):
        return "-" if v != v else f"{v:.4g}"  # NaN: nothing to say
    return "-" if v is None else str(v)


def _page(title: str, sections: list[tuple[str, str]]) -> str:
    parts = [f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>",
             f"<style>{CSS}</style><script>{_plotly_js()}</script></head><body>",
             f"<h1>{html.escape(title)}</h1>"]
    for heading, content in sections:
        parts.append(f"<h2>{html.escape(heading)}</h2>{content}")
    parts.append("</body></html>\n")
    return "".join(parts)


# -- one run ---------------------------------------------------------------------------------------

def theory_curve(codec, coords: int) -> pd.DataFrame:
    """The codec's expected per-packet NMSE on Gaussian input against bits per coordinate."""
    full = codec.body_bytes(coords)
    nbytes = torch.arange(0, full + 1, 4)
    nmse = codec.expected_nmse(torch.full_like(nbytes, coords), nbytes)
    return pd.DataFrame({"bits_per_coord": 8.0 * nbytes.numpy() / coords, "nmse": nmse.numpy()})


def summary(run: RunData, rows: pd.DataFrame | None) -> dict:
    """The run's outcome in one flat dict (also a row of a comparison)."""
    m, spec = run.manifest, run.experiment
    res = m.results
    c, wl = spec.congestion, spec.workload
    comm = wl.comm if wl.kind == "ddp" else "trimlab"
    out = {"run": m.name, "point": rundir.point_of(m.name),
           "seed": spec.seed, "status": m.status, "reason": m.reason,
           "comm": comm, "contender": contender(comm, codec_label(spec.codec), c,
                                                run.profile.discard_action if run.profile else "trim"),
           "load": " + ".join(f.rate for f in c.background) if c.background else "none",
           "codec": spec.codec.name, "topology": spec.topology,
           "inject_p": c.inject_probability, "action": c.inject_action,
           "background_flows": len(c.background), "steps": res.get("steps_done", wl.steps),
           "time_limit": bool(res.get("time_limit")),
           "final_acc": res.get("test_acc"), "wall_s": res.get("wall_s"),
           "parameters_identical": res.get("parameters_identical")}
    sw = res.get("switch", {})
    out |= {"switch_trims": sw.get("TRIM_PKTS"), "switch_drops": sw.get("DROP_PKTS")}
    out |= achieved_load(res.get("background", {})) | congestion(run)
    if rows is not None and len(rows):
        n = len(rows)
        out |= {"sent": n, "trimmed": int(rows["trimmed"].sum()), "dropped": int(rows["dropped"].sum()),
                "trimmed_rate": float(rows["trimmed"].mean()), "dropped_rate": float(rows["dropped"].mean())}
        out["affected_rate"] = out["trimmed_rate"] + out["dropped_rate"]
        t = rows[rows["trimmed"] & rows["nmse"].notna()]
        out["median_nmse_trimmed"] = float(t["nmse"].median()) if len(t) else None
    return out


def achieved_load(background: dict) -> dict:
    """What the background flows delivered beside what was asked: `achieved` in words
    ("18.9 of 19 Mbit/s", "short" where a flow fell below the tolerance), `load_short`."""
    if not background:
        return {"achieved": "-", "load_short": False}
    flows = [background[k] for k in sorted(background, key=int)]
    short = [f["offered_bps"] < (1 - match.LOAD_TOLERANCE) * f["requested_bps"] for f in flows]
    text = " + ".join(f"{f['offered_bps'] / 1e6:.3g} of {f['requested_bps'] / 1e6:.3g} Mbit/s" for f in flows)
    return {"achieved": text + (" (short)" if any(short) else ""), "load_short": any(short)}


def congestion(run: RunData) -> dict:
    """The congestion the run produced, from the switch's samples: the fullest queue's peak
    occupancy against its budget, and how long it was full (within one MTU of its budget)."""
    occ = run.occupancy
    budget = run.profile.buffer.queue_bytes if run.profile else None
    if not len(occ):
        return {"peak_occupancy": None, "buffer_bytes": budget, "full_s": None}
    out = {"peak_occupancy": int(occ["PEAK_OCCUPANCY"].max()), "buffer_bytes": budget, "full_s": None}
    if budget:
        frame = (run.cfg.mtu if run.cfg is not None else 1500) + 14
        step = float(occ.groupby(["port", "queue"])["time_s"].diff().median() or 0.0)
        full = occ[occ["OCCUPANCY"] + frame > budget].groupby(["port", "queue"]).size()
        out["full_s"] = round(float(full.max()) * step, 3) if len(full) else 0.0
    return out


def codec_label(codec: CodecSpec) -> str:
    """The codec's name, `_unrotated` where a rotated codec was told not to rotate."""
    return codec.name + ("_unrotated" if codec.params.get("rotate") is False else "")


def contender(comm: str, codec: str | None, congestion: CongestionSpec, discard_action: str = "trim") -> str:
    """What competes in a comparison: gloo, or trimlab with what the switch does to its
    packets (the injected action where injection is on, else the profile's) and its codec."""
    if comm == "gloo":
        return "gloo (TCP, drop)"
    action = congestion.inject_action if congestion.inject_probability else discard_action
    return f"trimlab {action} {codec}"


# two-sided 95 % quantiles of Student's t, by degrees of freedom (1..30); 1.96 beyond
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145,
        2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048,
        2.045, 2.042)


def mean_ci95(values) -> tuple[float | None, float | None]:
    """Mean and the half-width of its 95 % confidence interval (Student's t); a single
    value has no interval (None)."""
    v = [float(x) for x in values]
    if not v:
        return None, None
    n = len(v)
    mean = sum(v) / n
    if n == 1:
        return mean, None
    sd = (sum((x - mean) ** 2 for x in v) / (n - 1)) ** 0.5
    return mean, (_T95[n - 2] if n - 1 <= len(_T95) else 1.96) * sd / n ** 0.5


def aggregate(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point (runs that differ only in seed): seeds, and for final accuracy,
    steps to target and seconds to target the mean, 95 % interval and how many runs never
    reached the target; `*_text` says it in words ("never" where no run reached it)."""
    rows = []
    for point, g in df.groupby("point", sort=False):
        row = {"point": point, "seeds": len(g)}
        for k in ("contender", "load", "codec", "action", "inject_p", "comm"):
            if k in g:
                row[k] = g[k].iloc[0]
        if "achieved" in g:  # every seed's, so that a short one shows
            row["achieved"] = "; ".join(dict.fromkeys(g["achieved"].astype(str)))
        for m in ("final_acc", "steps_to_target", "seconds_to_target"):
            got = g[m].dropna() if m in g else pd.Series(dtype=float)
            never = len(g) - len(got)
            mean, ci = mean_ci95(got)
            row |= {f"{m}_mean": mean, f"{m}_ci95": ci, f"{m}_never": never}
            if mean is None:
                text = "never" if m != "final_acc" else "-"
            else:
                text = f"{mean:.4g}" + (f" ± {ci:.2g}" if ci is not None else "")
                if never:
                    text += f" (never in {never} of {len(g)})"
            row[f"{m}_text"] = text
        rows.append(row)
    return pd.DataFrame(rows)


# The paper's tolerance figures (HotNets '24, VGG-19 / CIFAR-100, trims emulated at a fixed
# probability), by the kind of contender nearest to each of ours.
PAPER_TOLERANCE = {
    "rotated": "about 50 % trimmed (its rotated variant)",
    "stochastic": "10–20 % trimmed (its stochastic-quantization variant)",
    "stock": "0.15–0.25 % dropped (stock NCCL)",
}


def _paper_kind(contender: str) -> str | None:
    if contender.startswith("gloo") or " drop " in f" {contender} ":
        return "stock"
    if contender.endswith(("embedded", "sign_tail")):
        return "rotated"
    if contender.endswith("sign_tail_unrotated"):  # the paper's head without the rotation
        return "stochastic"
    return None  # raw floats (fp32, bf16): the paper has no counterpart


def _no_worse(value, base_mean, base_ci, higher_is_better: bool) -> bool:
    """`value` lies in the base's 95 % interval or beyond it on the better side, edges
    included (one seed: no width): a run faster or more accurate than its p = 0 lost nothing."""
    if value is None or value != value:
        return False
    return (value - base_mean if higher_is_better else base_mean - value) >= -(base_ci or 0.0)


def injected_points(agg: pd.DataFrame) -> pd.DataFrame:
    """The points of a tolerance study: those without background load (loaded points are
    natural congestion, compared beside it, not on the p axis)."""
    return agg[agg["load"].fillna("none") == "none"] if "load" in agg else agg


def tolerance(agg: pd.DataFrame) -> pd.DataFrame:
    """Per contender: the largest injected probability p it tolerates — the largest p such
    that at it and at every smaller p the mean time to target is no worse than the 95 %
    interval of the contender's own p = 0, and nor is the mean final accuracy; "never" where even
    p = 0 never reached the target, "none" where the smallest p > 0 already fell out. Next
    to it, the paper's figure for the nearest kind of contender. Faster or more accurate
    than p = 0 counts as within. Loaded points are left out (`injected_points`)."""
    rows = []
    if agg is None or agg.empty or "inject_p" not in agg:
        return pd.DataFrame(rows)
    agg = injected_points(agg)
    for name, g in agg.groupby("contender", sort=False):
        g = g.assign(inject_p=g["inject_p"].fillna(0.0)).sort_values("inject_p", kind="stable")
        base = g[g["inject_p"] == 0]
        row = {"contender": name, "paper": PAPER_TOLERANCE.get(_paper_kind(name) or "", "-")}
        if base.empty:
            rows.append(row | {"tolerated_p": None, "tolerated": "no p = 0 point"})
            continue
        b = base.iloc[0]
        if b["seconds_to_target_mean"] is None or b["seconds_to_target_mean"] != b["seconds_to_target_mean"]:
            rows.append(row | {"tolerated_p": None, "tolerated": "never (p = 0 never reached the target)"})
            continue
        tolerated = 0.0
        for _, r in g[g["inject_p"] > 0].iterrows():
            if r["seconds_to_target_never"] or not (
                    _no_worse(r["seconds_to_target_mean"], b["seconds_to_target_mean"], b["seconds_to_target_ci95"],
                              higher_is_better=False)
                    and _no_worse(r["final_acc_mean"], b["final_acc_mean"], b["final_acc_ci95"],
                                  higher_is_better=True)):
                break
            tolerated = float(r["inject_p"])
        row["tolerated_p"] = tolerated
        row["tolerated"] = f"{100 * tolerated:g} %" if tolerated else "none (the smallest p > 0 already cost time or accuracy)"
        row["p0_seconds_to_target"] = b["seconds_to_target_text"]
        rows.append(row)
    return pd.DataFrame(rows)


def _summary_html(s: dict, run: RunData) -> str:
    keys = ["status", "reason", "codec", "topology", "inject_p", "action", "background_flows", "load", "achieved",
            "peak_occupancy", "buffer_bytes", "full_s", "steps",
            "final_acc", "wall_s", "sent", "trimmed", "dropped", "trimmed_rate", "dropped_rate",
            "switch_trims", "switch_drops", "median_nmse_trimmed", "parameters_identical"]
    def cls(k):  # the run's status is coloured
        return f' class="{html.escape(str(s[k]))}"' if k == "status" else ""

    rows = "".join(f"<tr><th>{k}</th><td{cls(k)}>{html.escape(fmt(s.get(k)))}</td></tr>" for k in keys if k in s)
    spec = html.escape(json.dumps(run.spec, indent=1))
    return (f'<table id="summary">{rows}</table>'
            f"<details><summary>resolved spec</summary><pre>{spec}</pre>"
            f"</details><p class=muted>{html.escape(str(run.path))}</p>")


def render_run(run: RunData) -> str:
    rows, chk, problem = None, [], None
    try:
        rows, chk = match.write(run.path)
    except (TrimlabError, OSError, ValueError, KeyError) as exc:
        problem = f"the packets of this run could not be matched: {exc}"
    s = summary(run, rows)
    sections = [("Summary", _summary_html(s, run) + (f"<p class=disagree>{html.escape(problem)}</p>" if problem else ""))]
    sections.append(("Congestion", _figure(figures.congestion(run.occupancy, run.traffic_events), "fig-congestion")))
    if run.fabric:
        sections.append(("Fabric", _figure(figures.fabric(run.topology.host_port, run.topology.links,
                                                          (run.counters or {}).get("ports", {})), "fig-fabric")))
    if rows is not None:
        theory = theory_curve(run.codec, run.cfg.codec.coords)
        sections.append(("Trims → error", _figure(figures.error_by_bits(rows, theory), "fig-error-bits")
                         + _figure(figures.error_by_step(rows), "fig-error-step")))
    sections.append(("Training", _figure(figures.training(run.metrics, run.steps), "fig-training")))
    sections.append(("Communication", _figure(figures.phases(run.metrics), "fig-phases")))
    ok = sum(c["status"] == match.AGREE for c in chk)
    sections.append((f"Observer agreement ({ok} of {len(chk)} agree)", _table(chk, "checks", "status")))
    return _page(f"trimlab run {s['run']}", sections)


def for_run(path: str | Path, console=None) -> Path:
    """Match, check and write the report of one run; returns report.html's path."""
    run = RunData.open(path)
    out = run.path / rundir.REPORT
    out.write_text(render_run(run))
    if console is not None:
        console.print(f"report: {out} ({observers_line(run.path)})")
    return out


def observers_line(run_dir: Path) -> str:
    """How the observers' checks came out, in a few words."""
    p = run_dir / rundir.CHECKS
    if not p.exists():
        return "packets not matched"
    chk = json.loads(p.read_text())
    if chk["all_agree"]:
        return "observers all agree"
    if chk["disagree"]:
        return f"{chk['disagree']} observer checks disagree: see the table"
    return "observers agree where they can tell; some differences have a known cause: see the table"


# -- several runs ----------------------------------------------------------------------------------

def expand(paths: list[str | Path]) -> list[Path]:
    """Run directories, with a sweep directory standing for its points."""
    out = []
    for p in map(Path, paths):
        if (p / rundir.SWEEP_POINTS).exists():
            out += sorted(d for d in p.iterdir() if d.is_dir() and (d / rundir.MANIFEST).exists())
        elif (p / rundir.MANIFEST).exists():
            out.append(p)
        else:
            raise RunDataError(f"{p}: neither a run directory nor a sweep (no {rundir.MANIFEST} or {rundir.SWEEP_POINTS})")
    return out


def packet_rows(run: RunData) -> pd.DataFrame | None:
    """The run's matched packet table (packets.parquet; matched now when absent), or None."""
    pq = run.path / rundir.PACKETS_TABLE
    if pq.exists():
        return pd.read_parquet(pq)
    try:
        return match.write(run.path)[0]
    except (TrimlabError, OSError, ValueError, KeyError):
        return None


def _curve(run: RunData) -> pd.DataFrame:
    m = run.metrics
    if m.empty:
        return pd.DataFrame(columns=["step", "loss", "test_acc", "t"])
    c = m.groupby("step").agg(loss=("loss", "mean"), t=("t", "max")).reset_index()
    st = run.steps
    if len(st) and "test_acc" in st:
        c = c.merge(st[["step", "test_acc"]], on="step", how="left")
    else:
        c["test_acc"] = float("nan")
    return c


def results(paths: list[str | Path], target_fraction: float = 0.95,
            target: float | None = None) -> tuple[pd.DataFrame, dict[str, pd.DataFrame]]:
    """One row per run (summary plus time to target accuracy) and each run's curve. The
    target: `target`, else the runs' spec's `target_accuracy`, else `target_fraction` of
    the best final accuracy among the runs (`target_source` says which)."""
    runs = [RunData.open(p) for p in expand(paths)]
    rows, curves = [], {}
    for run in runs:
        row = summary(run, packet_rows(run))
        if row["run"] in curves:  # the same spec run twice: tell them apart by directory
            row["run"] = run.path.name
        rows.append(row)
        curves[row["run"]] = _curve(run)
    df = pd.DataFrame(rows)
    source = "given"
    if target is None:
        target = next((r.experiment.target_accuracy for r in runs if r.experiment.target_accuracy is not None), None)
        source = "the spec's target_accuracy"
    if target is None:
        best = df["final_acc"].max() if "final_acc" in df and df["final_acc"].notna().any() else None
        target = target_fraction * best if best is not None else None
        source = f"{100 * target_fraction:g} % of the best final accuracy among these runs"
    to_step, to_s = [], []
    for name in df["run"]:
        c = curves[name]
        hit = c[c["test_acc"] >= target] if target is not None else c.iloc[0:0]
        to_step.append(int(hit["step"].iloc[0]) if len(hit) else None)
        to_s.append(float(hit["t"].iloc[0]) if len(hit) else None)
    df["target_acc"] = target
    df["target_source"] = source
    df["steps_to_target"], df["seconds_to_target"] = to_step, to_s
    if "affected_rate" not in df:
        df["affected_rate"] = None
    return df, curves


def compare(paths: list[str | Path], out: str | Path, target: float | None = None) -> Path:
    df, curves = results(paths, target=target)
    cols = ["run", "status", "contender", "load", "achieved", "peak_occupancy", "buffer_bytes", "full_s", "codec",
            "inject_p", "action", "background_flows", "trimmed_rate", "dropped_rate", "final_acc",
            "steps_to_target", "seconds_to_target", "median_nmse_trimmed", "wall_s"]
    table = df[[c for c in cols if c in df]].to_dict("records")
    for row in table:  # a run that never reached the target says so
        for k in ("steps_to_target", "seconds_to_target"):
            if row.get(k) is None or row[k] != row[k]:
                row[k] = "never"
    target = df["target_acc"].iloc[0] if len(df) else None
    source = df["target_source"].iloc[0] if len(df) else ""
    target_line = f"<p class=muted>target accuracy: {fmt(target)} ({html.escape(source)})</p>"
    sections = []
    agg = aggregate(df) if len(df) else pd.DataFrame()
    tol = tolerance(agg) if len(agg) and "inject_p" in agg and agg["inject_p"].fillna(0).gt(0).any() else None
    if tol is not None and len(tol):
        sections += [("Tolerance to injected trims and drops",
                      _figure(figures.tolerance_curves(injected_points(agg)), "fig-tolerance")
                      + f'<div style="overflow-x:auto">{_table(tol.to_dict("records"), "tolerance")}</div>'
                      + target_line)]
    if len(agg) and (agg["seeds"] > 1).any():
        shown = ["point", "contender", "load", "achieved", "inject_p", "seeds", "final_acc_text",
                 "steps_to_target_text", "seconds_to_target_text"]
        rows = agg[[c for c in shown if c in agg]].rename(columns=lambda c: c.replace("_text", "")).to_dict("records")
        sections += [
            ("Time to target against load", _figure(figures.time_to_target(agg), "fig-time-to-target") + target_line),
            ("Over seeds (mean ± 95 % interval)", f'<div style="overflow-x:auto">{_table(rows, "seeds")}</div>'),
        ]
    sections += [
        ("Accuracy against trim rate", _figure(figures.accuracy_vs_trim_rate(df.dropna(subset=["affected_rate"])),
                                               "fig-acc-trim-rate")),
        ("Training curves", _figure(figures.training_overlay(curves), "fig-overlay")),
        ("Results", f'<div style="overflow-x:auto">{_table(table, "results")}</div>' + target_line),
    ]
    out = Path(out)
    out.write_text(_page(f"trimlab comparison of {len(df)} runs", sections))
    return out
