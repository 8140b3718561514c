"""Figures: each a function from data (DataFrames, plain values) to a go.Figure; no I/O.

Run report: congestion (queue occupancy and trims over time, background flows marked),
error_by_bits (true per-packet NMSE against the bits per coordinate that arrived, with the
codec's theoretical curve), error_by_step, training (loss and accuracy against step and
wall time), phases (where each step's communication time goes), fabric (switches, hosts and
links with the trims leaving each port; a fabric run only). Comparison: training_overlay,
accuracy_vs_trim_rate, time_to_target.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from trimlab.config import PHASES

TEMPLATE = "plotly_white"
PALETTE = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _empty(title: str, why: str) -> go.Figure:
    fig = go.Figure()
    fig.add_annotation(text=why, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_layout(title=title, template=TEMPLATE, height=260,
                      xaxis={"visible": False}, yaxis={"visible": False})
    return fig


def congestion(occupancy: pd.DataFrame, events: pd.DataFrame | None = None,
               max_points: int = 4000) -> go.Figure:
    """Occupancy (bytes) and trims per second of every (port, queue) that saw any traffic
    or trim, against seconds since the first sample; background flows' on periods shaded."""
    title = "Congestion: switch queues over time"
    if occupancy is None or occupancy.empty:
        return _empty(title, "no occupancy samples (the switch records them on the virtual rack)")
    occ = occupancy.sort_values("time_s")
    t0 = occ["time_s"].min()
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.08,
                        subplot_titles=("queue occupancy (bytes)", "trims per second"))
    active = occ.groupby(["port", "queue"]).agg(occ=("PEAK_OCCUPANCY", "max"), tx=("TX_PKTS", "max"),
                                                trims=("TRIM_PKTS", "max"))
    active = active[(active["trims"] > 0) | (active["occ"] > 0)].sort_values("occ", ascending=False).head(8)
    for i, (port, queue) in enumerate(active.index):
        q = occ[(occ["port"] == port) & (occ["queue"] == queue)]
        step = max(1, len(q) // max_points)
        q = q.iloc[::step]
        t = q["time_s"].to_numpy() - t0
        color = PALETTE[i % len(PALETTE)]
        name = f"{port} q{queue}"
        fig.add_trace(go.Scatter(x=t, y=q["OCCUPANCY"], name=name, legendgroup=name, mode="lines",
                                 line={"color": color, "width": 1}), row=1, col=1)
        dt = np.diff(t, prepend=t[0])
        rate = np.diff(q["TRIM_PKTS"].to_numpy(), prepend=q["TRIM_PKTS"].iloc[0]) / np.where(dt > 0, dt, 1)
        fig.add_trace(go.Scatter(x=t, y=rate, name=name, legendgroup=name, showlegend=False, mode="lines",
                                 line={"color": color, "width": 1}), row=2, col=1)
    if events is not None and not events.empty:
        for flow, ev in events.sort_values("t").groupby("flow"):
            on = None
            for t, kind in zip(ev["t"] - t0, ev["event"]):
                if kind == "on" and on is None:
                    on = t
                elif kind == "off" and on is not None:
                    fig.add_vrect(x0=on, x1=t, fillcolor="orange", opacity=0.12, line_width=0)
                    on = None
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="background flow on",
                                 marker={"color": "orange", "symbol": "square", "opacity": 0.4}))
    fig.update_xaxes(title_text="seconds since the first sample", row=2, col=1)
    fig.update_layout(title=title, template=TEMPLATE, height=520, legend={"orientation": "h", "y": -0.15})
    return fig


def error_by_bits(packets: pd.DataFrame, theory: pd.DataFrame) -> go.Figure:
    """True NMSE of each packet with ground truth against the bits per coordinate that
    arrived (trimmed and whole packets, lost ones at 0 bits), the median per kept size,
    and the codec's expected NMSE on Gaussian input (`theory`: bits_per_coord, nmse)."""
    title = "Trims → error: true per-packet NMSE by bits per coordinate kept"
    p = packets[packets["nmse"].notna()] if "nmse" in packets else packets.iloc[0:0]
    if p.empty:
        return _empty(title, "no packet of a step with saved ground truth (truth.every)")
    fig = go.Figure()
    floor = 1e-12  # exact reconstructions plot at the floor of the log axis
    for label, sel, color in (("whole", ~p["trimmed"] & ~p["dropped"], PALETTE[0]),
                              ("trimmed", p["trimmed"], PALETTE[1]), ("lost", p["dropped"], "#555")):
        q = p[sel]
        if q.empty:
            continue
        fig.add_trace(go.Scatter(
            x=q["bits_per_coord"], y=q["nmse"].clip(lower=floor), mode="markers", name=f"{label} ({len(q)})",
            marker={"color": color, "size": 5, "opacity": 0.45},
            customdata=q[["step", "rank", "span", "packet", "recv_len"]].to_numpy(),
            hovertemplate="step %{customdata[0]} rank %{customdata[1]} span %{customdata[2]} "
                          "packet %{customdata[3]}<br>%{customdata[4]} bytes, %{x:.2f} bits/coord"
                          "<br>NMSE %{y:.3g}<extra></extra>"))
    med = p.groupby(p["bits_per_coord"].round(2))["nmse"].median().clip(lower=floor)
    fig.add_trace(go.Scatter(x=med.index, y=med.to_numpy(), mode="markers", name="median",
                             marker={"symbol": "diamond", "size": 10, "color": "black"}))
    if theory is not None and not theory.empty:
        fig.add_trace(go.Scatter(x=theory["bits_per_coord"], y=theory["nmse"].clip(lower=floor), mode="lines",
                                 name="theory (Gaussian input)", line={"color": "black", "dash": "dash"}))
    fig.update_layout(title=title, template=TEMPLATE, height=460, xaxis_title="bits per coordinate that arrived",
                      yaxis={"title": "NMSE ‖x̂ − x‖² / ‖x‖² per packet", "type": "log", "exponentformat": "power"})
    return fig


def error_by_step(packets: pd.DataFrame) -> go.Figure:
    """Per-packet true NMSE by step (steps with ground truth), trimmed packets in red."""
    title = "Per-packet error by training step"
    p = packets[packets["nmse"].notna()] if "nmse" in packets else packets.iloc[0:0]
    if p.empty:
        return _empty(title, "no packet of a step with saved ground truth (truth.every)")
    fig = go.Figure()
    rng = np.random.default_rng(0)  # deterministic jitter: the same run draws the same picture
    for label, sel, color in (("whole", ~p["trimmed"] & ~p["dropped"], PALETTE[0]),
                              ("trimmed", p["trimmed"], PALETTE[1]), ("lost", p["dropped"], "#555")):
        q = p[sel]
        if q.empty:
            continue
        fig.add_trace(go.Scatter(x=q["step"] + rng.uniform(-0.3, 0.3, len(q)), y=q["nmse"].clip(lower=1e-12),
                                 mode="markers", name=label, marker={"color": color, "size": 5, "opacity": 0.5}))
    fig.update_layout(title=title, template=TEMPLATE, height=380, xaxis_title="step",
                      yaxis={"title": "NMSE per packet", "type": "log", "exponentformat": "power"})
    return fig


def training(metrics: pd.DataFrame, steps: pd.DataFrame) -> go.Figure:
    """Training loss (mean over workers) and test accuracy against step and wall time."""
    title = "Training"
    if metrics is None or metrics.empty:
        return _empty(title, "no worker metrics")
    m = metrics.groupby("step").agg(loss=("loss", "mean"), t=("t", "max")).reset_index()
    fig = make_subplots(rows=1, cols=2, specs=[[{"secondary_y": True}, {"secondary_y": True}]],
                        subplot_titles=("against step", "against wall time (s)"))
    acc = steps[steps["test_acc"].notna()] if steps is not None and "test_acc" in steps else None
    for col, x, xacc in ((1, m["step"], acc["step"] if acc is not None else None),
                         (2, m["t"], acc["t"] if acc is not None else None)):
        fig.add_trace(go.Scatter(x=x, y=m["loss"], name="training loss", mode="lines", showlegend=col == 1,
                                 line={"color": PALETTE[0]}), row=1, col=col, secondary_y=False)
        if acc is not None and len(acc):
            fig.add_trace(go.Scatter(x=xacc, y=acc["test_acc"], name="test accuracy", mode="lines+markers",
                                     showlegend=col == 1, line={"color": PALETTE[2]}), row=1, col=col, secondary_y=True)
    fig.update_yaxes(title_text="loss", secondary_y=False)
    fig.update_yaxes(title_text="test accuracy", range=[0, 1], secondary_y=True)
    fig.update_layout(title=title, template=TEMPLATE, height=400, legend={"orientation": "h", "y": -0.2})
    return fig


def phases(metrics: pd.DataFrame) -> go.Figure:
    """Per step, the all-reduce's phases (encode, send, wait, decode, all-gather), in ms,
    averaged over the workers, stacked."""
    title = "Communication phases per step"
    have = [p for p in PHASES if metrics is not None and p in metrics and metrics[p].notna().any()]
    if not have:
        return _empty(title, "the workers' metrics have no phase times")
    m = metrics.groupby("step")[have].mean().reset_index()
    fig = go.Figure([go.Bar(x=m["step"], y=m[p], name=p.removesuffix("_ms"), marker={"color": PALETTE[i]})
                     for i, p in enumerate(have)])
    fig.update_layout(title=title, template=TEMPLATE, height=360, barmode="stack",
                      xaxis={"title": "step"}, yaxis={"title": "ms (mean over workers)"},
                      legend={"orientation": "h", "y": -0.2})
    return fig


def training_overlay(curves: dict[str, pd.DataFrame]) -> go.Figure:
    """Test accuracy (or loss) per step of several runs: {label: DataFrame(step, value, what)}."""
    title = "Training curves, overlaid"
    if not curves:
        return _empty(title, "no run has training metrics")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("training loss", "test accuracy"))
    for i, (label, c) in enumerate(curves.items()):
        color = PALETTE[i % len(PALETTE)]
        if "loss" in c and c["loss"].notna().any():
            fig.add_trace(go.Scatter(x=c["step"], y=c["loss"], name=label, legendgroup=label, mode="lines",
                                     line={"color": color}), row=1, col=1)
        a = c[c["test_acc"].notna()] if "test_acc" in c else c.iloc[0:0]
        if len(a):
            fig.add_trace(go.Scatter(x=a["step"], y=a["test_acc"], name=label, legendgroup=label,
                                     showlegend=False, mode="lines+markers", line={"color": color}), row=1, col=2)
    fig.update_xaxes(title_text="step")
    fig.update_layout(title=title, template=TEMPLATE, height=420)
    return fig


def accuracy_vs_trim_rate(results: pd.DataFrame) -> go.Figure:
    """Final accuracy and time-to-accuracy against the fraction of gradient packets trimmed
    or dropped, one line per (codec, action)."""
    title = "Accuracy against trim rate"
    if results is None or results.empty:
        return _empty(title, "no results")
    fig = make_subplots(rows=1, cols=2, subplot_titles=("final test accuracy", "steps to target accuracy"))
    for i, ((codec, action), r) in enumerate(results.sort_values("affected_rate").groupby(["codec", "action"])):
        color = PALETTE[i % len(PALETTE)]
        dash = "solid" if action == "trim" else "dot"
        name = f"{codec}, {action}"
        fig.add_trace(go.Scatter(x=r["affected_rate"], y=r["final_acc"], name=name, legendgroup=name,
                                 mode="lines+markers", line={"color": color, "dash": dash},
                                 text=r["run"], hovertemplate="%{text}<br>rate %{x:.3f}<br>acc %{y:.3f}<extra></extra>"),
                      row=1, col=1)
        fig.add_trace(go.Scatter(x=r["affected_rate"], y=r["steps_to_target"], name=name, legendgroup=name,
                                 showlegend=False, mode="lines+markers", line={"color": color, "dash": dash},
                                 text=r["run"]), row=1, col=2)
    fig.update_xaxes(title_text="fraction of gradient packets trimmed or dropped")
    fig.update_yaxes(title_text="accuracy", row=1, col=1)
    fig.update_yaxes(title_text="steps (none: never reached)", row=1, col=2)
    fig.update_layout(title=title, template=TEMPLATE, height=440)
    return fig


def _time_to_target_line(fig: go.Figure, x: pd.Series, g: pd.DataFrame, name: str, color: str, top: float,
                         hover: str) -> None:
    """One contender's mean time to target (95 % interval) at `x`; where no seed reached the
    target, an x at the top marked "never"."""
    reached = g["seconds_to_target_mean"].notna()
    fig.add_trace(go.Scatter(x=x, y=g["seconds_to_target_mean"].where(reached), name=name,
                             mode="lines+markers", line={"color": color},
                             error_y={"type": "data", "array": g["seconds_to_target_ci95"].fillna(0), "visible": True},
                             text=g["seconds_to_target_text"], hovertemplate=hover + "<extra>" + name + "</extra>"))
    if (~reached).any():
        fig.add_trace(go.Scatter(x=x[~reached], y=[top] * int((~reached).sum()), name=f"{name}: never",
                                 mode="markers+text", marker={"color": color, "symbol": "x", "size": 12},
                                 text=["never"] * int((~reached).sum()), textposition="top center",
                                 showlegend=False))


def tolerance_curves(agg: pd.DataFrame) -> go.Figure:
    """Wall time to the target against the injected probability p (log scale; p = 0 drawn
    at the left edge), one line per contender, mean and 95 % interval over seeds; a point
    where no seed reached the target is drawn at the top as "never"."""
    title = "Wall time to target accuracy against injected trims or drops"
    if agg is None or agg.empty or "inject_p" not in agg:
        return _empty(title, "no results")
    ps = sorted(v for v in agg["inject_p"].fillna(0) if v > 0)
    floor = (ps[0] / 3) if ps else 1e-4  # where p = 0 sits on the log axis
    top = max([v for v in agg["seconds_to_target_mean"].dropna()] + [1.0]) * 1.15
    fig = go.Figure()
    for i, (name, g) in enumerate(agg.groupby("contender", sort=False)):
        g = g.assign(x=g["inject_p"].fillna(0).where(g["inject_p"].fillna(0) > 0, floor)).sort_values("x")
        _time_to_target_line(fig, 100 * g["x"], g, name, PALETTE[i % len(PALETTE)], top, "p = %{x:.3g} %: %{text}")
    fig.update_xaxes(type="log", title_text=f"injected probability p, % (p = 0 drawn at {100 * floor:.2g} %)")
    fig.update_yaxes(title_text="seconds to target (mean ± 95 % interval)", rangemode="tozero")
    fig.update_layout(title=title)
    return fig


def time_to_target(agg: pd.DataFrame) -> go.Figure:
    """The headline: wall time to the target accuracy against background load, one line per
    contender, mean and 95 % interval over seeds; a point where no seed reached the target
    is drawn at the top as "never"."""
    title = "Wall time to target accuracy against background load"
    if agg is None or agg.empty or "load" not in agg:
        return _empty(title, "no results")
    loads = list(dict.fromkeys(agg["load"]))  # in the spec's order
    top = max([v for v in agg["seconds_to_target_mean"].dropna()] + [1.0]) * 1.15
    fig = go.Figure()
    for i, (name, g) in enumerate(agg.groupby("contender", sort=False)):
        if "inject_p" in g:  # injected points have their own table: loads only here
            g = g[g["inject_p"].fillna(0) == 0]
        if g.empty:
            continue
        _time_to_target_line(fig, g["load"], g, name, PALETTE[i % len(PALETTE)], top, "%{x}: %{text}")
    fig.update_xaxes(title_text="background load on each contender's own queue", categoryorder="array",
                     categoryarray=loads)
    fig.update_yaxes(title_text="seconds to target (mean ± 95 % interval)", rangemode="tozero")
    fig.update_layout(title=title, template=TEMPLATE, height=460)
    return fig


def fabric(host_port: dict[str, str], links: list[tuple[str, str]], ports: dict[str, dict]) -> go.Figure:
    """The run's switches, hosts and links, each link labelled with the packets trimmed
    (and dropped) leaving each of its ends; `host_port`: host -> switch:port, `links`:
    (switch:port, switch:port), `ports`: switch:port -> counters over the run."""
    title = "Fabric: trims per link and direction"
    if not links:
        return _empty(title, "one switch: no links between switches")
    sw_of = lambda p: p.split(":", 1)[0]  # noqa: E731
    leaves = sorted({sw_of(p) for p in host_port.values()})
    spines = sorted({sw_of(p) for link in links for p in link} - set(leaves))
    hosts = sorted(host_port, key=lambda h: (leaves.index(sw_of(host_port[h])), host_port[h]))
    pos = {}
    for row, names in ((2.0, spines), (1.0, leaves), (0.0, hosts)):
        for i, n in enumerate(names):
            pos[n] = ((i + 0.5) / len(names), row)

    def load(port: str) -> tuple[int, int]:
        c = ports.get(port, {})
        return c.get("TRIM_TX_PKTS", 0), c.get("DROP_PKTS", 0) + c.get("TRIM_DRP_PKTS", 0)

    edges = [(a, b) for a, b in links] + [(host_port[h], h) for h in hosts]
    busiest = max([sum(load(p)) for e in edges for p in e if ":" in p] + [1])
    fig = go.Figure()
    for a, b in edges:
        ends = [p for p in (a, b) if ":" in p]  # a switch port; a host end has none
        (x0, y0), (x1, y1) = pos[sw_of(a)], pos[sw_of(b) if ":" in b else b]
        trims = sum(load(p)[0] for p in ends)
        fig.add_trace(go.Scatter(x=[x0, x1], y=[y0, y1], mode="lines", hoverinfo="skip", showlegend=False,
                                 line={"width": 1 + 7 * trims / busiest, "color": "#d62728" if trims else "#999"}))
        text = "<br>".join(f"{p} →: {load(p)[0]} trimmed, {load(p)[1]} dropped" for p in ends)
        fig.add_trace(go.Scatter(x=[(x0 + x1) / 2], y=[(y0 + y1) / 2], mode="markers", showlegend=False,
                                 marker={"size": 6, "color": "#d62728" if trims else "#999"},
                                 hovertext=text, hoverinfo="text"))
        for p in ends:  # the count beside the port it left by
            px, py = (x0, y0) if sw_of(p) == sw_of(a) else (x1, y1)
            qx, qy = (x1, y1) if (px, py) == (x0, y0) else (x0, y0)
            t, d = load(p)
            if t or d:
                fig.add_annotation(x=px + 0.3 * (qx - px), y=py + 0.3 * (qy - py), showarrow=False,
                                   text=f"{t}✂" + (f" {d}✗" if d else ""), font={"size": 10, "color": "#d62728"})
    for names, symbol, color in ((spines, "square", "#1f77b4"), (leaves, "square", "#2ca02c"), (hosts, "circle", "#555")):
        fig.add_trace(go.Scatter(x=[pos[n][0] for n in names], y=[pos[n][1] for n in names], mode="markers+text",
                                 text=names, textposition="top center" if symbol == "square" else "bottom center",
                                 marker={"size": 18 if symbol == "square" else 10, "symbol": symbol, "color": color},
                                 hoverinfo="text", showlegend=False))
    fig.update_layout(title=title + " (✂ trimmed, ✗ dropped, beside the port they left by)", template=TEMPLATE,
                      height=460, xaxis={"visible": False, "range": [-0.05, 1.05]},
                      yaxis={"visible": False, "range": [-0.5, 2.5]})
    return fig
