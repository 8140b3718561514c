"""`trimlab run` itself: every point of a spec (a sweep's points one after another on one
rack), each into its own run directory; a sweep's directory holds them, its manifest and
a comparison report."""

from __future__ import annotations

import json
import secrets
import shutil
from pathlib import Path

import yaml

from trimlab.testbed import inventory as inv
from trimlab import rundir
from trimlab.testbed import provision
from trimlab.analysis import report
from trimlab.errors import SpecError, TrimlabError
from trimlab.testbed.orchestrator import progress
from trimlab.testbed.orchestrator.execution import Execution
from trimlab.testbed.orchestrator.placement import (
    RunFailed,
    check_profile,
    ddp_script,
    effective_profile,
    packet_coords,
    place,
)
from trimlab.rundir import RunDir, interrupted_reason
from trimlab.spec import ExperimentSpec, load_experiment
from trimlab.testbed.vrack import rack as vrack


def _rack_key(spec: ExperimentSpec) -> tuple:
    v = spec.rack.virtual
    return (v.workers, v.traffic_hosts, v.rate, v.mtu, spec.topology, v.fabric, v.platform,
            tuple(sorted(v.switch_platforms.items())))


def _provision(inventory: Path, profile_path: Path, switch_only: bool, console) -> None:
    out = provision.run(inventory, profile=str(profile_path), console=console,
                        limit="trim_switches" if switch_only else None,
                        tags="trim_switch" if switch_only else None)
    if out.failures or out.rc != 0:
        first = out.failures[0] if out.failures else {"host": "-", "task": "-", "msg": out.status}
        raise RunFailed(f"provisioning failed: {first['host']}: {first['task']}: {first['msg']}")
    if console is not None:
        changed = sum(r.changed for r in out.hosts.values())
        console.print(f"provisioned {len(out.hosts)} hosts ({changed} changes)")


def run(spec_path: str, inventory: str | None = None, overrides: list[str] = (), keep_rack: bool = False,
        runs_dir: Path = Path("runs"), console=None) -> list[Path]:
    """Run every point of the spec; returns the run directories. RunFailed if any failed."""
    spec = load_experiment(spec_path, overrides)
    points = spec.points()
    inventory = inventory or spec.rack.inventory  # -i, else the spec's rack.inventory
    lab = inv.load(inventory) if inventory else None
    for pt in points:  # everything validated before anything is touched
        check_profile(pt, lab)
        if pt.workload.kind == "ddp" and lab is None and not Path(ddp_script(pt)).is_file():
            raise SpecError(f"workload.script={ddp_script(pt)}: no such file")
        packet_coords(pt, int(lab.vars.get("data_mtu", 1500)) if lab else pt.rack.virtual.mtu)
        if lab is not None:
            place(lab, pt)
    parent, sweep = runs_dir, None
    if len(points) > 1:  # the sweep's own directory and manifest; one run directory per point
        sweep = RunDir.create(runs_dir, spec)
        parent = sweep.path
        (parent / rundir.SWEEP_POINTS).write_text(json.dumps([p.name for p in points], indent=2) + "\n")
    state, key, provisioned, dirs, failures = None, None, False, [], []
    try:
        for pt in points:
            if lab is None and _rack_key(pt) != key:
                if state is not None:
                    vrack.down(state)
                    state = None
                v = pt.rack.virtual
                rid = "r" + secrets.token_hex(3)[:5]
                f = v.fabric
                st = vrack.plan(rid, v.workers, 1 if pt.topology == "ps" else 0, v.traffic_hosts,
                                v.rate, v.mtu, 0.0, *((f.leaves, f.spines, f.uplink_rate) if f else (0, 0, None)),
                                platform=v.platform, switch_platforms=v.switch_platforms)
                if console is not None:
                    shape = f" on {f.leaves} leaves and {f.spines} spines" if f else ""
                    console.print(f"bringing up virtual rack {rid} ({v.workers} workers, {v.rate}{shape})")
                state, key, provisioned = vrack.up(st, owned=True), _rack_key(pt), False
            inventory_path = Path(inventory) if lab is not None else state.inventory
            rack = lab or inv.load(inventory_path)
            placement = place(rack, pt)
            mtu = int(rack.vars.get("data_mtu", 1500))
            rate = state.rate_bps if state else 1_000_000 * int(
                next(iter(placement.switches[0].ports.values())).get("speed_mbps", 100_000))
            with RunDir.create(parent, pt) as run_dir:
                dirs.append(run_dir.path)
                shutil.copy(inventory_path, run_dir.path / rundir.INVENTORY)
                run_dir.record(inventory=str(inventory_path), rack_id=state.id if state else None)
                prof = effective_profile(pt)
                prof_path = run_dir.path / rundir.SWITCH / rundir.profile_file(prof.name)
                prof_path.write_text(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False))
                try:
                    ex = Execution(pt, placement, run_dir, state.id if state else None, mtu, rate, console)
                    with ex.phase("provision"):
                        _provision(inventory_path, prof_path, switch_only=provisioned, console=console)
                    provisioned = True
                    results = ex.execute()
                except TrimlabError as exc:  # this point failed; the sweep goes on
                    failures.append(f"{pt.name}: {exc}")
                    run_dir.finish("failed", str(exc))
                    if console is not None:
                        console.print(f"[red]run {pt.name} failed:[/] {exc}  ({run_dir.path})")
                    continue
                if console is not None:
                    console.print(progress.summary(pt.name, results, run_dir.path))
            _report(run_dir.path, console)
    except BaseException as exc:
        if sweep is not None:
            if isinstance(exc, KeyboardInterrupt):  # the point it was on, and those never started
                names = [p.name for p in points]
                sweep.record(points=[str(d.relative_to(parent)) for d in dirs],
                             never_started=names[len(dirs):])
                sweep.finish("interrupted", interrupted_reason(exc, f"point {len(dirs)} of {len(points)}"
                                                                   if dirs else "bringing up the rack"))
            else:
                sweep.finish("failed", f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if state is not None and not keep_rack:
            vrack.down(state)
        elif state is not None and console is not None:
            console.print(f"rack {state.id} kept up: `trimlab rack down --id {state.id}` when done")
    if sweep is not None:
        sweep.record(points=[str(d.relative_to(parent)) for d in dirs])
        sweep.finish("failed" if failures else "succeeded", "; ".join(failures) or None)
        _report(parent, console, sweep=True)
    if failures:
        raise RunFailed("; ".join(failures) + f" (run directories under {parent})")
    return dirs


def _report(path: Path, console, sweep: bool = False) -> None:
    """The analysis entry point: a run's report, or a sweep's comparison of its points.
    A report that cannot be written is said, and does not fail the run."""
    try:
        if sweep:
            out = report.compare([path], path / rundir.REPORT)
            if console is not None:
                console.print(f"sweep report: {out}")
        else:
            report.for_run(path, console=console)
    except (TrimlabError, OSError, ValueError) as exc:
        if console is not None:
            console.print(f"[yellow]report for {path} not written:[/] {exc}")
