"""`trimlab`: the command line. It must start fast, so torch and friends are imported
inside the commands that need them. User errors (TrimlabError) print one line, exit 2."""

from __future__ import annotations

import json
import sys

import typer
from rich.console import Console
from rich.table import Table

from testbed.errors import TrimlabError

app = typer.Typer(help="trimlab: ML training over packet-trimming switches.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
bench_app = typer.Typer(help="Benchmarks; each prints JSON with same-run ratios.",
                        no_args_is_help=True)
app.add_typer(bench_app, name="bench")
console = Console(soft_wrap=True)
err_console = Console(stderr=True, soft_wrap=True)


@app.command()
def doctor(as_json: bool = typer.Option(False, "--json", help="print the checks as JSON")):
    """Check root, kernel features (netns, clsact, tc BPF), tools and Python packages."""
    from testbed.doctor import run_checks

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


@app.command()
def plan(trim_size: int = typer.Option(..., "--trim-size", help="switch trim size S (bytes from the Ethernet header)"),
         mtu: int = typer.Option(1500, help="IP MTU of the data network"),
         coords: int = typer.Option(None, help="coordinates per packet B (default: fill the MTU)"),
         codec: str = typer.Option("embedded", help="embedded | sign_tail | fp32 | bf16"),
         planes: int = typer.Option(None, help="embedded: bit planes K"),
         unbiased: bool = typer.Option(False, help="embedded/sign_tail: unbiased scaling"),
         ipv6: bool = typer.Option(False, "--ipv6", help="IPv6 instead of IPv4"),
         as_json: bool = typer.Option(False, "--json")):
    """Bits per coordinate that survive a trim of size S, and the expected NMSE."""
    from testbed.spec import TrimPlan, validated

    params = {}
    if planes is not None:
        params["planes"] = planes
    if unbiased:
        params["unbiased"] = True
    p = validated(TrimPlan, {"trim_size": trim_size, "mtu": mtu, "coords": coords,
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


@bench_app.command("codec")
def bench_codec(as_json: bool = typer.Option(False, "--json", help="print the JSON object only"),
                quick: bool = typer.Option(False, help="smaller NMSE tensors and fewer repeats (< 30 s)")):
    """NMSE per codec and kept size vs theory; encode+decode time over clone() time."""
    from bench.codec import run

    result = run(quick=quick)
    if as_json:
        print(json.dumps(result, indent=1))
        return
    table = Table("codec", "kept", "gaussian", "theory", "student_t3", "lognormal_s2")
    for r in result["nmse"]:
        table.add_row(r["codec"], r["kept"], f"{r['gaussian']:.4g}", f"{r['theory']:.4g}",
                      f"{r['student_t3']:.4g}", f"{r['lognormal_s2']:.4g}")
    console.print(table)
    for name, r in result["roundtrip"].items():
        console.print(f"{name}: encode {r['encode_ms']} ms + decode {r['decode_ms']} ms = "
                      f"{r['roundtrip_over_clone']}× clone ({r['clone_ms']} ms)")
    console.print(f"targets: {result['targets']}")


@app.command()
def demo():
    """The default experiment. Until the run command lands, this runs the codec benchmark."""
    err_console.print("[yellow]trimlab demo: the one-command experiment on the virtual rack is not "
                      "built yet; running the codec benchmark (`trimlab bench codec --quick`) instead[/]")
    bench_codec(as_json=False, quick=True)


def main() -> None:
    try:
        app()
    except TrimlabError as exc:
        err_console.print(f"[red]error:[/] {exc}", highlight=False, soft_wrap=True)
        sys.exit(exc.exit_code)


if __name__ == "__main__":
    main()
