"""The training progress line (rich): step, loss, trims and trims per second. Drawing only;
the numbers come from monitor.Training."""

from __future__ import annotations

import time

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from trimlab.analysis.match import LOAD_TOLERANCE
from trimlab.testbed.orchestrator.monitor import Training


class TrainingView:
    """A context manager; call it with the Training state to redraw."""

    def __init__(self, console, steps: int):
        self.bar = Progress(TextColumn("[bold]step"), MofNCompleteColumn(), BarColumn(),
                            TextColumn("loss {task.fields[loss]}"),
                            TextColumn("trims {task.fields[trims]} ({task.fields[rate]}/s)"), TimeElapsedColumn(),
                            console=console, transient=False, disable=console is None)
        self.steps = steps
        self.last = (time.monotonic(), 0)
        self.rate = 0.0

    def __enter__(self) -> "TrainingView":
        self.bar.__enter__()
        self.task = self.bar.add_task("train", total=self.steps, loss="-", trims="0", rate="0")
        return self

    def __call__(self, t: Training) -> None:
        now = time.monotonic()
        if now - self.last[0] >= 1.0:
            self.rate, self.last = (t.trimmed - self.last[1]) / (now - self.last[0]), (now, t.trimmed)
        self.bar.update(self.task, completed=t.step + 1, loss=f"{t.loss:.4f}" if t.loss is not None else "-",
                        trims=str(t.trimmed), rate=f"{self.rate:.0f}")

    def __exit__(self, *exc) -> None:
        if exc[0] is None:
            self.bar.update(self.task, completed=self.steps)
        self.bar.__exit__(*exc)


def summary(name: str, r: dict, path) -> str:
    """One run's closing lines."""
    sw = r.get("switch", {})
    ps = r.get("ps", {})
    acc = r.get("test_acc")
    # said, not assumed: a point meant to congest a port that trimmed and dropped nothing
    calm = " [yellow](no congestion: no port trimmed or dropped)[/]" if sw and not (
        sw.get("TRIM_PKTS") or sw.get("DROP_PKTS")) else ""
    short = "".join(f"\n  [yellow]flow {i} offered {b['offered_bps'] / 1e6:.1f} of {b['requested_bps'] / 1e6:.1f} "
                    f"Mbit/s ({b['ratio']:.0%}): the load fell short of the request[/]"
                    for i, b in r.get("background", {}).items() if b["ratio"] < 1 - LOAD_TOLERANCE)
    if r.get("time_limit"):
        short += f"\n  [yellow]stopped at its time limit after {r['steps_done']} of {r['steps']} steps[/]"
    return (f"[green]run {name} succeeded[/] in {r['wall_s']:.1f} s: test accuracy "
            f"{'-' if acc is None else format(acc, '.3f')}, switch trims {sw.get('TRIM_PKTS', '-')}, "
            f"drops {sw.get('DROP_PKTS', '-')}{calm}, "
            f"ps saw {ps.get('trimmed', '-')} trimmed of {ps.get('received', '-')} packets "
            f"({ps.get('missing', '-')} missing); parameters identical: {r['parameters_identical']}{short}\n"
            f"  {path}")
