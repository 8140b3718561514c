"""After a run: everything the agents wrote, over SFTP, into the run directory, and the
run's results from it."""

from __future__ import annotations

import errno
import time
from pathlib import Path

from trimlab import rundir
from trimlab.testbed import remote
from trimlab.analysis.rundata import RunData
from trimlab.errors import TrimlabError
from trimlab.testbed.orchestrator.events import Done
from trimlab.testbed.orchestrator.placement import Placement, RunFailed
from trimlab.rundir import RunDir


def collect(run: RunDir, fleet: remote.Fleet, remote_dirs: dict[str, str], remote_root: str,
            switch_dirs: dict[str, Path]) -> None:
    """Each host's remote directory into agents/<host>/ (pcaps, truth and each switch's
    occupancy series, into `switch_dirs[host]`, where the layout puts them), then removed
    there. Best effort: what failed is recorded in the manifest."""
    def one(name: str, s: remote.Session) -> list[Path] | str:
        try:
            got = s.get_tree(remote_dirs[name], run.path / rundir.AGENTS / name)
            s.run(["rm", "-rf", remote_dirs[name]], timeout=60)
            s.run(["rmdir", "--ignore-fail-on-non-empty", remote_root], timeout=60)
            return got
        except OSError as exc:
            if exc.errno == errno.ENOSPC:  # not this host's fault: the run directory is full
                raise
            return f"{name}: {exc}"
        except (TrimlabError, EOFError) as exc:
            return f"{name}: {exc}"

    errors = []
    for host, got in fleet.each(one).items():  # every host at once
        if isinstance(got, str):
            errors.append(got)
            continue
        for f in got:
            if f.parent.name == rundir.PCAPS:
                f.replace(run.path / rundir.PCAPS / f.name)
            elif f.parent.name == rundir.TRUTH:
                f.replace(run.path / rundir.TRUTH / f.name)
            elif f.name == rundir.OCCUPANCY and host in switch_dirs:
                switch_dirs[host].mkdir(parents=True, exist_ok=True)
                f.replace(switch_dirs[host] / rundir.OCCUPANCY)
    for d in (run.path / rundir.AGENTS).glob("*/*"):
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    if errors:
        run.record(collect_errors=errors)


def background_flow(data: RunData, i: int) -> dict:
    """One background flow as three observers saw it: asked, offered by its sender (bytes over
    its on-time), received by the switch's port from its host (where the switch counts it and
    the flow is its host's only one) and by its sink (after the switch's trims and drops)."""
    f = data.background_load[i]
    rate = lambda n: round(n * 8 / f["on_s"]) if f["on_s"] > 0 else 0  # noqa: E731
    out = {"requested_bps": f["rate_bps"], "offered_bps": f["offered_bps"], "on_s": f["on_s"],
           "ratio": round(f["offered_bps"] / f["rate_bps"], 4), "paced_by": f.get("paced_by", "user space")}
    alone = [j for j, g in data.background_load.items() if g["host"] == f["host"]] == [i]
    flow = data.experiment.congestion.background[i] if i < len(data.experiment.congestion.background) else None
    at_switch = data.switch_port_payload(f["host"], flow.protocol) if alone and flow else None
    if at_switch is not None:
        out["at_switch_bps"] = rate(at_switch)
    if "received_bytes" in f:
        out["received_bps"] = rate(f["received_bytes"])
    return out


def results(run: RunDir, p: Placement, steps: int, script_results: dict[int, Done], t0: float) -> dict:
    """The run's outcome from what was collected; RunFailed if the models diverged."""
    agents = run.path / rundir.AGENTS
    finals = {d.name: f for d in agents.iterdir() if (f := rundir.Final.read(d))} if agents.exists() else {}
    out: dict = {"wall_s": round(time.monotonic() - t0, 2), "steps": steps}
    data = RunData.open(run.path)
    counters = data.counters  # every switch of the run, summed
    if counters is not None:
        out["switch"] = counters["switch"]
    if data.background_load:  # what each background flow offered, against what it was asked
        out["background"] = {str(i): background_flow(data, i) for i, f in sorted(data.background_load.items())
                             if f.get("rate_bps")}
    for rank, w in enumerate(p.workers):  # a DDP script without the hook (comm gloo): its last line
        if w.name not in finals and rank in script_results and script_results[rank].checksum:
            done = script_results[rank]
            finals[w.name] = rundir.Final(role="worker", rank=rank, checksum=done.checksum, test_acc=done.test_acc)
    workers = {n: f for n, f in finals.items() if f.role == "worker"}
    for f in workers.values():  # the DDP hook knows gradients, the script its accuracy
        if f.test_acc is None and f.rank in script_results:
            f.test_acc = script_results[f.rank].test_acc
    out["workers"] = {n: {"test_acc": f.test_acc, "checksum": f.checksum} for n, f in workers.items()}
    ran = {d.steps for d in script_results.values() if d.steps is not None}
    if ran:  # a DDP script says how many steps it ran: fewer where its time limit stopped it
        out["steps_done"] = min(ran)
        out["time_limit"] = any(d.time_limit for d in script_results.values())
    checksums = {f.checksum for f in finals.values()}
    out["parameters_identical"] = len(checksums) == 1 and len(workers) == len(p.workers)
    ps = next((f for f in finals.values() if f.role == "ps"), None)
    if ps:
        out["ps"] = ps.model_dump(include={"received", "trimmed", "missing", "expected", "discarded"})
    accs = [f.test_acc for f in finals.values()]
    out["test_acc"] = accs[0] if accs else None
    run.record(results=out)
    if len(workers) != len(p.workers):
        missing = sorted({w.name for w in p.workers} - set(workers))
        raise RunFailed(f"workers {', '.join(missing)} wrote no {rundir.FINAL}")
    if not out["parameters_identical"]:
        raise RunFailed(f"parameters differ across hosts: {sorted(checksums)}")
    return out
