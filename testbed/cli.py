"""`trimlab`: the command line. It must start fast, so the modules that load torch, pandas
and plotly (benches, experiments, reports) are imported inside the commands that need
them. User errors (TrimlabError) print one line, exit 2."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from trimlab.testbed import provision as prov
from trimlab import resources, rundir
from trimlab.testbed.doctor import run_checks
from trimlab.config import parse_rate
from trimlab.errors import SpecError, TrimlabError
from trimlab.spec import TrimPlan, load_profile, validated
from trimlab import platforms
from trimlab.testbed.targets import Port, get_target
from trimlab.testbed.vrack import rack, vswitch

app = typer.Typer(help="trimlab: ML training over packet-trimming switches.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
bench_app = typer.Typer(help="Benchmarks; each prints JSON with same-run ratios.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
rack_app = typer.Typer(help="The virtual rack on this machine.", no_args_is_help=True)
app.add_typer(rack_app, name="rack")
switch_app = typer.Typer(help="The switch of a virtual rack.", no_args_is_help=True)
app.add_typer(switch_app, name="switch")
wireshark_app = typer.Typer(help="The trimlab dissector for Wireshark and tshark.", no_args_is_help=True)
app.add_typer(wireshark_app, name="wireshark")
RACK_ID = typer.Option(None, "--id", help="rack id (default: the only rack up)")
SWITCH = typer.Option(None, "--switch", help="which switch of a fabric (leaf1, spine1...; default: the only one)")
# Not a terminal (a log, a pipe): wide enough that tables are not cut.
console = Console(soft_wrap=True, width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True, soft_wrap=True)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="print the checks as JSON")):
    """Check root, kernel features (netns, clsact, tc BPF), tools and Python packages."""
    checks = run_checks()
    failed = [c for c in checks if c.required and not c.ok]
    if as_json:
        print(json.dumps([c.__dict__ for c in checks], indent=2))
    else:
        table = Table("check", "status", "detail", "fix", title="trimlab doctor")
        for c in checks:
            status = "[green]ok[/]" if c.ok else ("[red]missing[/]" if c.required else "[yellow]warn[/]")
            table.add_row(c.name, status, c.detail, "" if c.ok else c.fix)
        console.print(table)
        console.print(f"[red]{len(failed)} check(s) failed[/]" if failed else "[green]all required checks passed[/]")
    raise typer.Exit(1 if failed else 0)


@app.command("platforms")
def platforms_(as_json: bool = typer.Option(False, "--json", help="print the catalog as JSON")):
    """The switch platforms trimlab knows: what each does to a trimmed packet."""
    cat = platforms.catalog()
    if as_json:
        print(json.dumps({n: p.model_dump() | {"needs_repair": p.needs_repair} for n, p in cat.items()}, indent=2))
        return
    table = Table("platform", "runs", "stale after a trim", "trim sizes", "trim queues", "marking",
                  "trims twice", title="switch platforms (switch_configs/platforms.yml)")
    for p in cat.values():
        table.add_row(p.name, ", ".join(p.targets), ", ".join(p.stale) or "nothing", p.trim_size.text(),
                      f"{min(p.trim_queues)}..{max(p.trim_queues)} (default {p.default_trim_queue})",
                      p.marking, "yes" if p.trims_twice else "no")
    console.print(table)


@app.command()
def plan(trim_size: int = typer.Option(..., "--trim-size", help="switch trim size S (bytes from the Ethernet header)"),
         mtu: int = typer.Option(1500, help="IP MTU of the data network"),
         coords: int = typer.Option(None, help="coordinates per packet B (default: fill the MTU, at most a span)"),
         span: int = typer.Option(4096, help="the rotation's span (codec.span in a spec)"),
         codec: str = typer.Option("embedded", help="embedded | sign_tail | fp32 | bf16"),
         planes: int = typer.Option(None, help="embedded: bit planes K"),
         unbiased: bool = typer.Option(False, help="embedded/sign_tail: unbiased scaling"),
         ipv6: bool = typer.Option(False, "--ipv6", help="IPv6 instead of IPv4"),
         as_json: bool = typer.Option(False, "--json")):
    """Bits per coordinate that survive a trim of size S, and the expected NMSE."""
    params = {}
    if planes is not None:
        params["planes"] = planes
    if unbiased:
        params["unbiased"] = True
    p = validated(TrimPlan, {"trim_size": trim_size, "mtu": mtu, "coords": coords, "span": span,
                             "codec": codec, "codec_params": params, "ipv6": ipv6})
    f = p.figures()
    if as_json:
        print(json.dumps(f, indent=2))
        return
    console.print(f"{f['codec']} {f['codec_params']} over {f['ip']}, MTU {f['mtu']}, B = {f['coords']} coordinates")
    console.print(f"  packet: {f['frame_bytes']} bytes on the wire (Ethernet, no FCS), "
                  f"{f['bits_per_coord_sent']:.2f} bits/coord, expected NMSE {f['expected_nmse_untrimmed']:.3g}")
    if not f["trimmed"]:
        console.print(f"  trim size {f['trim_size']} ≥ packet size: such packets are never cut")
    else:
        console.print(f"  trimmed to {f['trim_size']}: {f['body_bytes_kept']} body bytes, "
                      f"{f['bits_per_coord_kept']:.3f} bits/coord, expected NMSE {f['expected_nmse_trimmed']:.3g}")
        if f["rotated"] and not f["every_coord_kept"]:
            console.print(f"  [yellow]warning:[/] a trim leaves {f['coords'] - 8 * f['body_bytes_kept']} coordinates "
                          f"without a bit; {f['codec']} is rotated, so the receiver counts the whole span missing "
                          f"and a trim acts as a drop. Use --coords {f['max_coords_every_coord_kept']} or fewer "
                          "(codec.coords in a spec)")


@bench_app.command("codec")
def bench_codec(as_json: bool = typer.Option(False, "--json", help="print the JSON object only"),
                quick: bool = typer.Option(False, help="smaller NMSE tensors and fewer repeats (< 30 s)"),
                threads: int = typer.Option(1, min=1, help="threads of the native kernels"),
                device: str = typer.Option("cpu", help="cuda: the GPU's wire bytes against the CPU's, and its GB/s"),
                isa: str = typer.Option(None, help="also time these native vector paths side by side, e.g. "
                                                   "avx2,plain, or all that this CPU runs")):
    """NMSE per codec and kept size vs theory; encode+decode time over clone() time, the
    native kernels next to the torch reference."""
    from trimlab.bench.codec import run  # heavy (torch, pandas): only for this command

    result = run(quick=quick, threads=threads, device=device, isa=isa)
    if as_json or device == "cuda":  # the GPU's figures are JSON only
        print(json.dumps(result, indent=1))
        return
    table = Table("codec", "kept", "gaussian", "theory", "student_t3", "lognormal_s2")
    for r in result["nmse"]:
        table.add_row(r["codec"], r["kept"], f"{r['gaussian']:.4g}", f"{r['theory']:.4g}",
                      f"{r['student_t3']:.4g}", f"{r['lognormal_s2']:.4g}")
    console.print(table)
    for name, r in result["roundtrip"].items():
        console.print(f"{name} ({r['implementation']}): encode {r['encode_ms']} ms + decode {r['decode_ms']} ms = "
                      f"{r['roundtrip_over_clone']}× clone ({r['clone_ms']} ms), {r['mb_per_s']} MB/s"
                      + (f", {r['speedup_over_torch']}× the torch reference" if "speedup_over_torch" in r else ""))
    for level, rows in result.get("by_isa", {}).items():
        console.print(f"{level}: " + ", ".join(f"{name} {r['roundtrip_over_clone']}× clone"
                                               for name, r in rows.items() if name != "built_for"))
    console.print(f"targets: {result['targets']}")


@rack_app.command("up")
def rack_up(workers: int = typer.Option(4, help="worker hosts"),
            ps: int = typer.Option(1, help="parameter-server hosts (0 or 1)"),
            traffic: int = typer.Option(1, help="background-traffic hosts (0..2)"),
            rate: str = typer.Option("1gbit", help="data port rate"),
            mtu: int = typer.Option(1500, help="data network MTU"),
            delay: float = typer.Option(0.0, help="one-way delay added at each host NIC, ms"),
            rack_id: str = typer.Option("0", "--id", help="rack id: 1-6 lowercase letters/digits"),
            leaves: int = typer.Option(0, help="a routed leaf–spine fabric with this many leaves (0: one switch)"),
            spines: int = typer.Option(0, help="spines of the fabric (every leaf has an uplink to each)"),
            uplink_rate: str = typer.Option(None, help="leaf–spine link rate (default: the port rate)"),
            platform: str = typer.Option(platforms.VIRTUAL_DEFAULT, help="the switch platform every switch emulates "
                                         "(trimlab platforms lists them)"),
            switch_platform: list[str] = typer.Option([], help="SWITCH=PLATFORM: one switch emulates another "
                                                      "platform (repeatable)"),
            repair: bool = typer.Option(True, help="trimlab's receive repair on every host (--no-repair: "
                                        "hosts as they come, which drop stale trimmed packets)")):
    """Build a virtual rack: namespaces, management bridge, sshd, the trimming switch (or a
    leaf–spine fabric of them)."""
    per_switch = {}
    for item in switch_platform:
        sw, sep, name = item.partition("=")
        if not sep:
            raise SpecError(f"--switch-platform {item!r}: use SWITCH=PLATFORM, e.g. spine1=uec-1.0")
        per_switch[sw] = name
    st = rack.plan(rack_id, workers, ps, traffic, rate, mtu, delay, leaves, spines, uplink_rate,
                   platform, per_switch, repair)
    with console.status(f"building rack {rack_id} ({len(st.hosts)} namespaces)"):
        rack.up(st)
    switches = ", ".join(sw.ns for sw in st.switches)
    console.print(f"rack {st.id} is up: {len(st.nic_hosts)} hosts, switch{'es' if st.fabric else ''} "
                  f"{switches}, management 198.18.{st.slot}.0/24")
    print(st.inventory)


@rack_app.command("status")
def rack_status(rack_id: str = RACK_ID, as_json: bool = typer.Option(False, "--json")):
    """Hosts, ports, whether sshd answers and the switch program is attached."""
    info = rack.status(rack.resolve(rack_id))
    if as_json:
        print(json.dumps(info, indent=2))
        return
    missing = [n for n, ok in info["switch_programs"].items() if not ok]
    table = Table("host", "role", "mgmt", "data", "switch", "port", "netns", "sshd",
                  title=f"rack {info['id']}: switch program "
                        + (f"MISSING on {', '.join(missing)}" if missing else "attached"))
    for h in info["hosts"]:
        table.add_row(h["name"], h["role"], h["mgmt_ip"], h["data_ipv4"], h["switch"], h["port"],
                      "ok" if h["namespace"] else "[red]gone[/]", "ok" if h["sshd"] else "[red]down[/]")
    console.print(table)
    console.print(f"inventory: {info['inventory']}")


@rack_app.command("down")
def rack_down(rack_id: str = RACK_ID,
              everything: bool = typer.Option(False, "--all", help="remove every tl* object, state file or not"),
              stale: bool = typer.Option(False, "--stale", help="remove every rack whose owner is gone "
                                                             "(never one whose owner lives)")):
    """Take a rack down; nothing of it remains."""
    if stale:
        gone = rack.reclaim()
        for rid, why in gone.items():
            console.print(f"rack {rid} reclaimed: {why}")
        console.print(f"{len(gone)} stale rack(s) reclaimed")
        return
    if everything:
        ids = rack.down_all()
        console.print(f"removed every tl* namespace, link and pin (racks: {', '.join(ids) or 'none recorded'})")
        return
    st = rack.resolve(rack_id)
    rack.down(st)
    console.print(f"rack {st.id} is down")


@switch_app.command("apply")
def switch_apply(config: str = typer.Argument(..., help="SONiC Config DB fragment (JSON)"),
                 rack_id: str = RACK_ID,
                 check: bool = typer.Option(False, "--check", help="change nothing; say what would change"),
                 report: bool = typer.Option(False, "--report", help="print {changed, diff} as JSON (for Ansible)"),
                 switch: str = SWITCH):
    """Change the running switch (validated whole first; counters are kept)."""
    sw = rack.resolve(rack_id).vswitch(switch)
    doc = vswitch.load_config_file(config)
    _, cfg, diff = sw.plan(doc)
    if diff and not check:
        sw.apply(doc)
    if report:
        print(json.dumps({"changed": bool(diff), "diff": diff}))
        return
    verb = "would change" if check else "changed"
    console.print(f"{verb} {len(diff)} setting(s): trim size {cfg.size}, dscp {cfg.dscp_value}, "
                  f"queue {cfg.queue_index}" if diff else "unchanged")


@switch_app.command("show")
def switch_show(rack_id: str = RACK_ID, switch: str = SWITCH):
    """The running configuration, as a SONiC Config DB fragment."""
    print(json.dumps(rack.resolve(rack_id).vswitch(switch).read().to_config_db(), indent=2))


@switch_app.command("counters")
def switch_counters(rack_id: str = RACK_ID, as_json: bool = typer.Option(False, "--json"),
                    switch: str = SWITCH):
    """SONiC-named counters at switch, port and queue level."""
    c = rack.resolve(rack_id).vswitch(switch).counters()
    if as_json:
        print(json.dumps(c, indent=2))
        return
    table = Table("port", *vswitch.COUNTERS, "PEAK_OCCUPANCY")
    for port, row in c["ports"].items():
        table.add_row(port, *(str(row[k]) for k in vswitch.COUNTERS), str(row["PEAK_OCCUPANCY"]))
    table.add_row("switch", *(str(c["switch"][k]) for k in vswitch.COUNTERS), "")
    console.print(table)


@switch_app.command("render")
def switch_render(profile: str = typer.Argument(..., help="profile name (switch_configs/profiles) or path"),
                  target: str = typer.Option(..., help="sonic | cumulus | vswitch"),
                  ports: str = typer.Option(None, help="comma-separated ports, NAME or NAME:network "
                                                      "(default: the target's example ports)")):
    """Print what a profile would apply on a target: config data and CLI lines."""
    t = get_target(target)
    port_list = list(t.default_ports)
    if ports:
        port_list = [Port(*p.split(":", 1)) for p in ports.split(",")]
    print(t.render(load_profile(profile), port_list).text(), end="")


@switch_app.command("sample")
def switch_sample(out: str = typer.Option(..., "--out", help="CSV file to write"),
                  interval: float = typer.Option(0.01, help="seconds between samples"),
                  duration: float = typer.Option(None, help="stop after this many seconds (default: until signalled)"),
                  rack_id: str = RACK_ID, switch: str = SWITCH):
    """Record occupancy and counters per port and queue into a CSV, until stopped."""
    st = rack.resolve(rack_id)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    pidfile = st.dir / "run" / f"sampler-{os.getpid()}.pid"  # so that `rack down` stops it
    pidfile.write_text(f"{os.getpid()}\n")
    try:
        n = vswitch.sample(st.vswitch(switch), out, interval, duration, stop)
    finally:
        pidfile.unlink(missing_ok=True)
    err_console.print(f"{n} samples written to {out}")


@bench_app.command("switch")
def bench_switch(as_json: bool = typer.Option(False, "--json", help="print the JSON object only"),
                 quick: bool = typer.Option(False, help="shorter points, fewer rounds")):
    """Packets/s through the virtual switch: program vs none, all trimmed vs none trimmed."""
    from trimlab.bench.switch import run  # heavy (torch, pandas): only for this command

    result = run(quick=quick)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("pcap")
def bench_pcap(as_json: bool = typer.Option(False, "--json", help="print the JSON object only"),
               quick: bool = typer.Option(False, help="50 k packets instead of 1 M"),
               packets: int = typer.Option(None, min=1000, help="packets in the capture")):
    """Packets/s of the capture reader on a 1 M-packet capture, vs dpkt and tshark -T fields."""
    from trimlab.bench.pcap_read import run  # heavy (torch, pandas): only for this command

    result = run(quick=quick, packets=packets)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("transport")
def bench_transport(as_json: bool = typer.Option(False, "--json", help="print the JSON object only"),
                    quick: bool = typer.Option(False, help="1 s points, 3 rounds"),
                    mtu: int = typer.Option(1500, help="data network MTU (1280..9000): packets fill it")):
    """Gradient packets/s a worker sends and a ps receives and decodes, ÷ blast.c's rate."""
    from trimlab.bench.transport_rate import run  # heavy (torch): only for this command

    _check_mtu(mtu)
    result = run(quick=quick, mtu=mtu)
    print(json.dumps(result, indent=None if as_json else 2))


@bench_app.command("ddp")
def bench_ddp(as_json: bool = typer.Option(False, "--json", help="print the JSON object only"),
              quick: bool = typer.Option(False, help="models 5k and 1M, fewer steps, one round"),
              models: str = typer.Option(None, help="comma-separated, of 5k, 1M, 5M (default: all; --quick: 5k,1M)"),
              rates: str = typer.Option("100mbit", help="port rates, comma-separated, e.g. 100mbit,1gbit,2500mbit"),
              mtu: int = typer.Option(1500, help="data network MTU (1280..9000)")):
    """Step time of a DDP script with trimlab's comm hook vs gloo all-reduce, on a virtual rack."""
    from trimlab.bench.ddp import MODELS, run  # heavy (torch, pandas): only for this command

    chosen = [m.strip() for m in models.split(",")] if models else None
    if chosen and (bad := [m for m in chosen if m not in MODELS]):
        raise TrimlabError(f"--models {','.join(bad)}: choose from {', '.join(MODELS)}")
    listed = [r.strip() for r in rates.split(",") if r.strip()]
    for r in listed:
        try:
            bps = parse_rate(r)
        except SpecError:
            raise TrimlabError(f"--rates {r}: use a number with kbit, mbit or gbit (e.g. 1gbit)") from None
        if not 1_000_000 <= bps <= 100_000_000_000:
            raise TrimlabError(f"--rates {r}: use 1mbit..100gbit")
    _check_mtu(mtu)
    result = run(quick=quick, models=chosen, rates=listed, mtu=mtu)
    print(json.dumps(result, indent=None if as_json else 2))


def _check_mtu(mtu: int) -> None:
    if not 1280 <= mtu <= 9000:
        raise TrimlabError(f"--mtu {mtu}: use 1280..9000")


@app.command()
def provision(inventory: str = typer.Option(None, "-i", "--inventory", help="Ansible YAML inventory "
                                            "(default: the running virtual rack)"),
              profile: str = typer.Option("default", help="trimming profile (switch_configs/profiles)"),
              check: bool = typer.Option(False, "--check", help="show what would change, change nothing"),
              limit: str = typer.Option(None, help="only these hosts/groups (Ansible pattern)"),
              tags: str = typer.Option(None, help="only these roles: trim_switch,nic_host,trimlab_agent,capture"),
              rack_id: str = RACK_ID):
    """Configure trimming on every switch and prepare every host, through Ansible."""
    inv = Path(inventory) if inventory else prov.default_inventory(rack_id)
    out = prov.run(inv, profile=profile, check=check, limit=limit, tags=tags, console=console)
    table = Table("host", "ok", "changed", "failed", "skipped", "unreachable",
                  title=f"provision {'(check) ' if check else ''}profile {profile}: {out.status}")
    for host, r in sorted(out.hosts.items()):
        table.add_row(host, str(r.ok), str(r.changed), str(r.failed), str(r.skipped), str(r.unreachable))
    console.print(table)
    for c in out.changes:
        console.print(f"  changed: {c['host']}: {c['task']}")
    if out.failures or out.rc != 0:
        for f in out.failures:
            err_console.print(f"[red]failed:[/] {f['host']}: {f['task']}: {f['msg']}", highlight=False)
        raise prov.ProvisionError(f"provisioning failed ({len(out.failures)} failure(s), ansible rc {out.rc})")


@app.command("run")
def run_cmd(spec: str = typer.Argument(..., help="experiment spec (YAML), e.g. experiments/default.yaml"),
            inventory: str = typer.Option(None, "-i", "--inventory",
                                          help="a lab inventory (default: bring up a virtual rack)"),
            overrides: list[str] = typer.Option([], "--set", help="override a spec key: key.path=value"),
            keep_rack: bool = typer.Option(False, "--keep-rack", help="leave the virtual rack up"),
            runs: str = typer.Option("runs", help="directory for run directories")):
    """Run an experiment (every point of its sweep): rack, provisioning, agents, artifacts."""
    from trimlab.testbed import orchestrator  # heavy (torch, pandas): only for this command

    for rid, why in rack.stale().items():
        err_console.print(f"[yellow]warning:[/] stale rack {rid} ({why}): `trimlab rack down --stale` "
                          "removes it", highlight=False)
    try:
        orchestrator.run(spec, inventory, overrides, keep_rack, Path(runs), console=console)
    except KeyboardInterrupt as exc:
        err_console.print(f"[red]{rundir.interrupted_reason(exc)}:[/] agents stopped, rack taken down, "
                          "run marked interrupted")
        raise typer.Exit(128 + getattr(exc, "signum", signal.SIGINT)) from None


@app.command()
def report(runs: list[str] = typer.Argument(..., help="run directories, or a sweep directory"),
           out: str = typer.Option(None, "-o", "--out", help="output HTML (default: RUN/report.html for "
                                   "one run, SWEEP/report.html for a sweep, else ./comparison.html)"),
           target: float = typer.Option(None, "--target", help="the accuracy to time runs to (default: the "
                                        "spec's target_accuracy, else 95 % of the best final accuracy)")):
    """Write a run's interactive report (packets.parquet, checks.json, report.html), or one
    page comparing several runs or a sweep's points."""
    from trimlab.analysis import (
        report as rep,  # heavy (torch, pandas): only for this command
    )

    paths = [Path(r) for r in runs]
    single = len(paths) == 1 and not (paths[0] / rundir.SWEEP_POINTS).exists()
    if single and out is None:
        console.print(f"report: {rep.for_run(paths[0])}")
        return
    if out is None:
        out = str(paths[0] / rundir.REPORT) if len(paths) == 1 else "comparison.html"
    runs_found = rep.expand(paths)
    console.print(f"comparison of {len(runs_found)} runs: {rep.compare(paths, out, target)}")


@app.command("runs")
def runs_cmd(root: str = typer.Argument("runs", help="the directory `trimlab run --runs` wrote to"),
             as_json: bool = typer.Option(False, "--json", help="print the listing as JSON")):
    """List past runs, newest first: name, start, status, accuracy, trims, wall time."""
    from trimlab.analysis import notebook  # heavy (pandas): only for this command
    from trimlab.analysis.report import fmt

    df = notebook.list_runs(root)
    if as_json:
        print(df.assign(started=df["started"].astype(str)).to_json(orient="records", indent=1))
        return
    table = Table("name", "started (UTC)", "status", "accuracy", "trims", "drops", "wall s", "path",
                  title=f"trimlab runs in {root}")
    for r in df.astype(object).where(df.notna(), None).itertuples():
        table.add_row(r.name, r.started.strftime("%Y-%m-%d %H:%M:%S") if r.started else "-", r.status or "-",
                      fmt(r.accuracy), fmt(r.trims), fmt(r.drops), fmt(r.wall_s), r.path)
    console.print(table if len(df) else f"no runs in {root}")


@app.command()
def demo(runs: str = typer.Option("runs", help="directory for run directories")):
    """The default experiment (experiments/default.yaml) on a virtual rack."""

    spec = resources.data("experiments", "default.yaml")
    run_cmd(str(spec), None, [], False, runs)


def main() -> None:
    # SIGINT, SIGTERM and SIGHUP unwind every command alike: agents stopped, racks down
    rundir.stop_signals_as_interrupt()
    try:
        app()
    except TrimlabError as exc:
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)
    except SystemExit:
        sig = rundir.received_signal()
        if sig is not None:  # click turned the interrupt into "Aborted!", exit 1
            sys.exit(128 + sig)
        raise


@wireshark_app.command("path")
def wireshark_path():
    """Print the dissector's path (for `tshark -X lua_script:PATH` or Wireshark's Lua dialog)."""
    from trimlab.analysis import wireshark
    print(wireshark.plugin_path())


@wireshark_app.command("install")
def wireshark_install(folder: Path = typer.Option(None, "--dir", help="plugin folder (default: Wireshark's "
                                                  "personal Lua plugin folder, from `tshark -G folders`)")):
    """Copy the dissector into your personal Wireshark plugin folder (run again after an upgrade)."""
    from trimlab.analysis import wireshark
    target = wireshark.install(folder)
    console.print(f"installed {target}: Wireshark and tshark dissect trimlab packets from their next start "
                  "(filter: trimlab or trimlab_ctrl)")


if __name__ == "__main__":
    main()
