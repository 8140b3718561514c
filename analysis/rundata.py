"""Everything a run directory holds, loaded for analysis: the manifest, the agents'
configuration, the rack's cabling, captures (with tcpdump's own statistics), the ps log,
step and worker metrics, switch counters and occupancy, ground truth, background-flow
events. Each loader returns None (or an empty frame) where a failed run left nothing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from trimlab import rundir, wire
from trimlab.analysis import pcap
from trimlab.analysis.topology import Topology, qualified
from trimlab.codec import get_codec
from trimlab.config import GRADIENT_PORT, AgentConfig
from trimlab.errors import TrimlabError
from trimlab.spec import ExperimentSpec, TrimProfile


class RunDataError(TrimlabError):
    """A directory that is not a trimlab run (or lacks what analysis needs)."""


@dataclass
class RunData:
    path: Path

    @classmethod
    def open(cls, path: str | Path) -> "RunData":
        path = Path(path)
        if not (path / rundir.MANIFEST).exists():
            raise RunDataError(f"{path}: no {rundir.MANIFEST}; give a run directory (runs/<time>-<name>)")
        return cls(path)

    # -- what the run was --------------------------------------------------------------------
    @cached_property
    def manifest(self) -> rundir.Manifest:
        return rundir.Manifest.read(self.path)

    @cached_property
    def spec(self) -> dict:
        """The resolved spec as recorded (see `experiment` for the model)."""
        return self.manifest.spec

    @cached_property
    def experiment(self) -> ExperimentSpec:
        """The run's resolved spec, as the model it was validated by."""
        return ExperimentSpec.model_validate(self.spec)

    @cached_property
    def cfg(self) -> AgentConfig | None:
        """The agents' configuration (agent.json): absent when the run failed before it."""
        p = self.path / rundir.AGENT_CONFIG
        return AgentConfig.read(p) if p.exists() else None

    @cached_property
    def codec(self):
        return get_codec(self.cfg.codec.name, **self.cfg.codec.params)

    @cached_property
    def topology(self) -> Topology:
        return Topology.from_manifest(self.manifest)

    @property
    def fabric(self) -> bool:
        """The run drove several switches: ports are named switch:port."""
        return self.topology.fabric

    @cached_property
    def hosts(self) -> dict[str, dict]:
        """host -> {role, addr (data address of the run's family), port (switch port; switch:port
        in a fabric)}, from the host facts the run recorded in its manifest."""
        ipv6 = bool(self.cfg and self.cfg.transport.ipv6)
        ports = self.topology.host_port
        return {name: {"role": f.get("role"), "addr": f.get("data_ipv6" if ipv6 else "data_ipv4"),
                       "port": ports.get(name, f.get("switch_port"))}
                for name, f in self.manifest.hosts.items()}

    @cached_property
    def receivers(self) -> list[str]:
        """Hosts that receive gradient packets: the ps, or every worker when sharded."""
        if not self.cfg:
            return []
        return [w.name for w in self.cfg.workers] if self.cfg.topology == "sharded" else [self.cfg.ps.name]

    # -- what the agents wrote ---------------------------------------------------------------
    def agent_csv(self, host: str, name: str) -> pd.DataFrame | None:
        p = self.path / rundir.AGENTS / host / name
        return pd.read_csv(p) if p.exists() and p.stat().st_size else None

    @cached_property
    def packet_log(self) -> pd.DataFrame:
        """Every receiver's packets.csv (one row per gradient datagram), with `receiver`."""
        parts = []
        for host in self.receivers:
            df = self.agent_csv(host, rundir.PACKET_LOG)
            if df is not None:
                parts.append(df.assign(receiver=host))
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    @cached_property
    def steps(self) -> pd.DataFrame:
        """The ps's steps.csv (topology ps); else (a DDP script) rank 0's printed test
        accuracies with the script's clock (step, t, test_acc); else empty."""
        if not self.cfg:
            return pd.DataFrame()
        if self.cfg.ps:
            df = self.agent_csv(self.cfg.ps.name, rundir.STEPS)
            return df if df is not None else pd.DataFrame()
        printed = self.progress(self.cfg.workers[0].name)
        if "test_acc" not in printed or "t" not in printed:
            return pd.DataFrame()
        return printed.loc[printed["test_acc"].notna(), ["step", "t", "test_acc"]].reset_index(drop=True)

    @cached_property
    def metrics(self) -> pd.DataFrame:
        """Every worker's metrics.csv, with `worker` and `rank`. Where it has no loss (the DDP
        hook sees gradients, not losses), the loss the training script printed in its
        progress lines is used, and a DDP script's own clock (`t` in its lines, the same for
        trimlab's hook and gloo) replaces the hook's. A DDP script without the hook (comm
        gloo) has only its printed lines."""
        parts = []
        for rank, w in enumerate(self.cfg.workers if self.cfg else []):
            df = self.agent_csv(w.name, rundir.METRICS)
            printed = self.progress(w.name)
            if df is None:
                if not len(printed) or "t" not in printed:
                    continue
                df = printed[["step", "loss", "t"]].copy()
            else:
                if df["loss"].isna().all() and len(printed):
                    df = df.drop(columns="loss").merge(printed[["step", "loss"]], on="step", how="left")
                if "t" in printed and len(printed):
                    df = df.drop(columns="t").merge(printed[["step", "t"]], on="step", how="left")
            parts.append(df.assign(worker=w.name, rank=rank))
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    def progress(self, host: str) -> pd.DataFrame:
        """The step lines (JSON: event step, step, loss, ...) a host's worker printed."""
        log = self.path / rundir.LOGS / rundir.log_file(host, "worker")
        rows = []
        for line in log.read_text().splitlines() if log.exists() else []:
            if line.startswith("{") and '"step"' in line:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                if ev.get("event") == "step" and "loss" in ev:
                    rows.append(ev)
        return pd.DataFrame(rows, columns=sorted({k for r in rows for k in r} | {"step", "loss"}))

    def layout(self, rank: int) -> rundir.GradientLayout | None:
        return rundir.GradientLayout.read(self.path / rundir.AGENTS / self.cfg.workers[rank].name)

    # -- captures --------------------------------------------------------------------------------
    def capture(self, host: str) -> pd.DataFrame | None:
        """All of a host's capture files (rotated ones too), read and concatenated in time."""
        def rotation(f: Path) -> str:  # tcpdump -C: NAME.pcap, NAME.pcap1, NAME.pcap2, ...
            return f.name.removeprefix(rundir.pcap_file(host))

        files = sorted((f for f in (self.path / rundir.PCAPS).glob(rundir.pcap_file(host) + "*")
                        if rotation(f) == "" or rotation(f).isdigit()), key=lambda f: int(rotation(f) or 0))
        if not files:
            return None
        port = self.cfg.transport.port if self.cfg else GRADIENT_PORT
        frames = [pcap.read(f, port=port) for f in files]
        return pd.concat(frames, ignore_index=True).sort_values("ts_ns", kind="stable") \
            if len(frames) > 1 else frames[0]

    def capture_stats(self, host: str) -> dict | None:
        """tcpdump's own counts (per interface) for a host's capture."""
        p = self.path / rundir.PCAPS / rundir.capture_stats_file(host)
        return json.loads(p.read_text()) if p.exists() else None

    # -- the switch --------------------------------------------------------------------------------
    @cached_property
    def counters(self) -> dict | None:
        """Switch counters over the run: after − before, at switch, port and queue level; in a
        fabric every switch's, ports named switch:port, the switch level summed over them."""
        out: dict = {"switch": {}, "ports": {}, "queues": {}}
        delta = lambda x, y: {k: v - y.get(k, 0) if "OCCUPANCY" not in k else v for k, v in x.items()}  # noqa: E731
        for label, d in rundir.switch_dirs(self.path).items():
            b, a = d / rundir.COUNTERS_BEFORE, d / rundir.COUNTERS_AFTER
            if not (b.exists() and a.exists()):
                return None
            before, after = json.loads(b.read_text()), json.loads(a.read_text())
            for k, v in delta(after["switch"], before["switch"]).items():
                out["switch"][k] = out["switch"].get(k, 0) + v
            for p, v in after["ports"].items():
                out["ports"][qualified(label, p)] = delta(v, before["ports"].get(p, {}))
            for p, qs in after["queues"].items():
                out["queues"][qualified(label, p)] = [delta(q, before["queues"].get(p, [{}] * len(qs))[i])
                                                      for i, q in enumerate(qs)]
        return out if out["ports"] else None

    @cached_property
    def repairs(self) -> dict[str, dict | None] | None:
        """Per NIC host, what its receive repair counted over the run ({seen, repaired,
        refused}: after − before), None for a host without one; None for a run that
        recorded no repair status (a lab whose hosts would not say)."""
        b, a = self.path / rundir.REPAIR_BEFORE, self.path / rundir.REPAIR_AFTER
        if not (b.exists() and a.exists()):
            return None
        before, after = json.loads(b.read_text()), json.loads(a.read_text())
        out = {}
        for host, now in after.items():
            was = before.get(host)
            if now is None or was is None:
                out[host] = None
                continue
            if now.get("counters") is None or was.get("counters") is None:  # unreadable (not root)
                out[host] = {"error": now.get("error") or now.get("counters_error") or was.get("error")
                             or was.get("counters_error")}
                continue
            out[host] = {k: v - was["counters"].get(k, 0) for k, v in now["counters"].items()} | {"port": now["port"]}
        return out

    @cached_property
    def platforms(self) -> dict[str, dict]:
        """Switch label -> its platform as the run recorded it: {name, stale (header fields
        a trim leaves stale), needs_repair}."""
        return self.manifest.platforms

    @cached_property
    def occupancy(self) -> pd.DataFrame:
        """Every switch's samples; ports named switch:port in a fabric."""
        parts = []
        for label, d in rundir.switch_dirs(self.path).items():
            p = d / rundir.OCCUPANCY
            if p.exists() and p.stat().st_size:
                df = pd.read_csv(p)
                if label:
                    df["port"] = label + ":" + df["port"].astype(str)
                parts.append(df)
        return pd.concat(parts, ignore_index=True) if parts else pd.DataFrame()

    @cached_property
    def profile(self) -> TrimProfile | None:
        """The effective trimming profile the switches ran (None: not recorded)."""
        files = sorted((self.path / rundir.SWITCH).glob(rundir.profile_file("*")))
        return TrimProfile.model_validate(yaml.safe_load(files[0].read_text())) if files else None

    # -- ground truth and background flows ------------------------------------------------------
    def truth(self, step: int, rank: int) -> np.ndarray | None:
        p = self.path / rundir.TRUTH / rundir.truth_file(step, rank)
        return np.load(p) if p.exists() else None

    @cached_property
    def truth_steps(self) -> list[tuple[int, int]]:
        return sorted(rundir.truth_key(f.name) for f in (self.path / rundir.TRUTH).glob(rundir.TRUTH_GLOB))

    @cached_property
    def background_load(self) -> dict[int, dict]:
        """Each background flow's closing summary (sender side), by flow index: the rate
        asked (rate_bps), bytes, the time it was on (on_s), what it offered (offered_bps) and
        the host that sent it; with its sink's count where the sink finished (received_bytes,
        received_packets: what came through the switch, trims and drops taken off)."""
        out = {}
        for flow, host, ev in self._summaries("traffic"):
            if ev.get("role") == "send" and "offered_bps" in ev:
                out[flow] = ev | {"host": host}
        for flow, _, ev in self._summaries("sink"):
            if ev.get("role") == "sink" and flow in out:
                out[flow] |= {"received_bytes": ev["bytes"], "received_packets": ev.get("packets")}
        return out

    def switch_port_payload(self, host: str, protocol: str) -> int | None:
        """The payload bytes the switch's port received from `host` over the run (its RX
        counters less each frame's headers); None where the switch does not count them."""
        port = self.hosts.get(host, {}).get("port")
        got = ((self.counters or {}).get("ports") or {}).get(port) or {}
        if "RX_BYTES" not in got:
            return None
        ipv6 = bool(self.cfg and self.cfg.transport.ipv6)
        per = wire.ETH_LEN + (wire.ip_udp_overhead(ipv6) if protocol == "udp" else (40 if ipv6 else 20) + 32)
        return max(0, got["RX_BYTES"] - got["RX_PKTS"] * per)

    def _summaries(self, kind: str):
        """(flow, host, summary) of every `kind`<flow> agent's log (traffic, sink)."""
        for log in sorted((self.path / rundir.LOGS).glob(rundir.log_file("*", f"{kind}*"))):
            host, _, flow = log.stem.rpartition(f"-{kind}")
            if not flow.isdigit():
                continue
            for line in log.read_text().splitlines():
                if line.startswith("{") and '"summary"' in line:
                    try:
                        yield int(flow), host, json.loads(line)
                    except ValueError:
                        continue

    @cached_property
    def traffic_events(self) -> pd.DataFrame:
        """Background flows switching on and off: t (s, epoch), flow, event."""
        rows = []
        for log in sorted((self.path / rundir.LOGS).glob(rundir.log_file("*", "traffic*"))):
            flow = log.stem.rsplit("-", 1)[-1]
            for line in log.read_text().splitlines():
                if line.startswith("{"):
                    try:
                        ev = json.loads(line)
                    except ValueError:
                        continue
                    if ev.get("event") in ("on", "off") and "t" in ev:
                        rows.append({"t": ev["t"], "flow": flow, "event": ev["event"]})
        return pd.DataFrame(rows, columns=["t", "flow", "event"])
