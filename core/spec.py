"""Specs and their validation (pydantic): the trim plan, the trimming profile and the
experiment spec, with the loaders of their YAML files. Every error names the field and
what to do. The orchestrator runs them; the analysis reads a run's recorded spec and
profile back through them."""

from __future__ import annotations

import copy
import ipaddress
import itertools
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trimlab import resources, wire
from trimlab.config import GRADIENT_PORT, WorkloadConfig
from trimlab.errors import CodecError, SpecError
from trimlab import platforms

CodecName = Literal["embedded", "sign_tail", "fp32", "bf16"]


def read_yaml(path: str | Path, what: str):
    """A YAML file's content; a missing or malformed file is one SpecError line."""
    try:
        return yaml.safe_load(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"{what} {path}: no such file") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{what} {path}: not valid YAML ({' '.join(str(exc).split())})") from None


def validated(model: type[BaseModel], data: dict[str, Any], where: str = ""):
    """Build `model` from `data`; a ValidationError becomes one SpecError line naming the
    first bad field (as a dotted path under `where`)."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        path = ".".join(str(p) for p in (where, *err["loc"]) if p != "")
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "literal_error":
            msg = f"must be one of {err['ctx']['expected']}"
        raise SpecError(f"{path or model.__name__}: {msg}" +
                        (f" (got {err['input']!r})" if "input" in err and path else "")) from None


class TrimPlan(BaseModel):
    """What a trim to `trim_size` bytes leaves of one gradient packet."""

    model_config = ConfigDict(extra="forbid")

    trim_size: int = Field(gt=0, description="switch trim size S, from the Ethernet header")
    mtu: int = Field(1500, ge=576, le=9216)
    coords: int | None = Field(None, description="coordinates per packet B (default: fill the MTU, at most a span)")
    span: int = Field(4096, description="the rotation's span: a packet carries at most one span (jumbo frames "
                                        "hold more than 4096 coordinates of some codecs)")
    codec: CodecName = "embedded"
    codec_params: dict[str, Any] = Field(default_factory=dict)
    ipv6: bool = False

    @model_validator(mode="after")
    def _check(self):
        from trimlab.codec import get_codec  # heavy (torch): the CLI starts without it

        # SpecError (not ValueError) passes through pydantic, keeping the field's name.
        if self.ipv6 and self.mtu < 1280:
            raise SpecError(f"mtu={self.mtu}: IPv6 needs an MTU of at least 1280")
        floor = wire.min_trim_size(self.ipv6)
        if self.trim_size < floor:
            raise SpecError(f"trim_size={self.trim_size}: cannot keep the {wire.HEADER_LEN}-byte "
                             f"trimlab header over {'IPv6' if self.ipv6 else 'IPv4'}/UDP: "
                             f"use at least {floor}")
        if self.span < 32 or self.span & (self.span - 1):
            raise SpecError(f"span={self.span}: use a power of two, at least 32")
        codec = get_codec(self.codec, **self.codec_params)
        best = wire.max_coords(codec, self.mtu, self.ipv6)
        if self.coords is None:
            self.coords = wire.fill_coords(codec, self.mtu, self.span, self.ipv6)  # as a run chooses
        elif self.coords % 32 or self.coords <= 0:
            raise SpecError(f"coords={self.coords}: B must be a positive multiple of 32")
        elif self.coords > best:
            raise SpecError(f"coords={self.coords}: does not fit mtu={self.mtu} with codec "
                             f"{self.codec}: at most {best}")
        return self

    def figures(self) -> dict[str, Any]:
        """The plan's numbers: sizes, bits per coordinate kept, expected NMSE."""
        import torch  # heavy: the CLI starts without it

        from trimlab.codec import get_codec  # heavy (torch): the CLI starts without it

        codec = get_codec(self.codec, **self.codec_params)
        body = codec.body_bytes(self.coords)
        frame = wire.ETH_LEN + wire.ip_udp_overhead(self.ipv6) + wire.HEADER_LEN + body
        kept = min(body, wire.kept_body_bytes(self.trim_size, self.ipv6))
        c = torch.tensor([self.coords])
        nmse = lambda n: float(codec.expected_nmse(c, torch.tensor([n]))[0])
        return {
            "codec": codec.name,
            "codec_params": codec.params(),
            "ip": "IPv6" if self.ipv6 else "IPv4",
            "mtu": self.mtu,
            "coords": self.coords,
            "trim_size": self.trim_size,
            "frame_bytes": frame,
            "trimmed": self.trim_size < frame,
            "body_bytes_sent": body,
            "body_bytes_kept": kept,
            "bits_per_coord_sent": 8 * body / self.coords,
            "bits_per_coord_kept": 8 * kept / self.coords,
            "expected_nmse_untrimmed": nmse(body),
            "expected_nmse_trimmed": nmse(kept),
            # a rotated codec needs a bit for every coordinate of a span: a trim that keeps
            # less leaves the whole span missing at the receiver (the trim acts as a drop)
            "rotated": codec.rotated,
            "every_coord_kept": 8 * kept >= self.coords,
            "max_coords_every_coord_kept": min((8 * kept) // 32 * 32, self.coords),
        }


# -- trimming profiles ---------------------------------------------------------------------



class BufferSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    queue_bytes: int = Field(65536, ge=0, description="byte budget of every data queue")
    trim_queue_bytes: int = Field(65536, ge=0, description="byte budget of the trimmed-packet queue")


class InjectionSpec(BaseModel):
    """Deterministic injection (virtual switch only): trim or drop an eligible packet when a
    hash of its identity falls under `probability`."""

    model_config = ConfigDict(extra="forbid")

    probability: float = Field(0.0, ge=0.0, le=1.0)
    action: Literal["trim", "drop"] = "trim"
    seed: int = Field(0, ge=0, lt=1 << 32)
    queues: list[Annotated[int, Field(ge=0, le=7)]] = Field(
        default_factory=list, description="the queues it reaches (default: the profile's eligible queues)")


class TrimProfile(BaseModel):
    """A trimming profile: what the switches do, independent of the switch OS. Validated
    once here; each target checks its own limits before anything is rendered or sent."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9_-]*$")
    description: str = ""
    size: int = Field(gt=0, description="trim size, bytes from the Ethernet header (FCS excluded)")
    dscp: int | Literal["from-tc"] = Field(48, description="DSCP of trimmed packets, or from-tc")
    trim_tc: int | None = Field(None, ge=0, le=7, description="traffic class of trimmed packets (from-tc)")
    port_dscp: dict[Literal["host", "network"], int] = Field(
        default_factory=dict, description="from-tc: DSCP of trimmed packets leaving host-facing "
                                          "and network-facing ports (the inventory says which is which)")
    queue: int | Literal["dynamic"] = Field(7, description="queue of trimmed packets, or dynamic")
    eligible_queues: list[int] = Field(default_factory=lambda: [1], min_length=1)
    discard_action: Literal["trim", "drop"] = Field(
        "trim", description="what the eligible queues do with a packet over their budget: trim, or drop "
        "(the baseline: the same queues and budgets, dropping)")
    dscp_to_tc: dict[int, int] | None = Field(None, description="default: DSCP >> 3 (class selector)")
    buffer: BufferSpec = Field(default_factory=BufferSpec)
    port_speed_mbps: int | None = Field(None, ge=1, le=800_000)
    exempt_sources: list[str] = Field(default_factory=list, description="source prefixes never trimmed")
    injection: InjectionSpec = Field(default_factory=InjectionSpec)

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.queue, int) and not 0 <= self.queue <= 255:
            raise SpecError(f"queue={self.queue}: a queue index is 0..255, or 'dynamic'")
        for q in self.eligible_queues:
            if not 0 <= q <= 7:
                raise SpecError(f"eligible_queues: {q} is not a queue/traffic class 0..7")
        if self.queue in self.eligible_queues:  # SONiC's BUFFER_QUEUE would name PORT|q twice
            raise SpecError(f"queue={self.queue} is also in eligible_queues {self.eligible_queues}: trimmed "
                            "packets need a queue of their own (its own budget); pick one outside eligible_queues")
        if self.dscp == "from-tc":
            if self.trim_tc is None or not self.port_dscp:
                raise SpecError("dscp=from-tc needs trim_tc (0..7) and port_dscp "
                                "(a DSCP per group of egress ports)")
        for facing, d in self.port_dscp.items():
            if not 0 <= d <= 63:
                raise SpecError(f"port_dscp.{facing}={d}: a DSCP is 0..63")
        if self.dscp != "from-tc" and (self.port_dscp or self.trim_tc is not None):
            raise SpecError("trim_tc and port_dscp only apply with dscp: from-tc")
        elif self.dscp != "from-tc" and not 0 <= self.dscp <= 63:
            raise SpecError(f"dscp={self.dscp}: a DSCP is 0..63, or 'from-tc'")
        for d, tc in (self.dscp_to_tc or {}).items():
            if not (0 <= d <= 63 and 0 <= tc <= 7):
                raise SpecError(f"dscp_to_tc: {d}: {tc} must map a DSCP 0..63 to a traffic class 0..7")
        for src in self.exempt_sources:
            try:
                ipaddress.ip_network(src)
            except ValueError:
                raise SpecError(f"exempt_sources: {src!r} is not an IP prefix (e.g. 198.19.0.13/32)") from None
        return self

    def tc_of(self, dscp: int) -> int:
        """Traffic class of a DSCP: the profile's map (unmapped: 0), else DSCP >> 3."""
        return self.dscp_to_tc.get(dscp, 0) if self.dscp_to_tc is not None else dscp >> 3

    def trimmed_dscp(self, facing: Literal["host", "network"]) -> int:
        """The DSCP a packet trimmed at a port of this facing carries."""
        return self.port_dscp[facing] if self.dscp == "from-tc" else self.dscp

    def trimmed_dscps(self) -> set[int]:
        """Every DSCP a trimmed packet can carry (from-tc: one per port facing)."""
        return set(self.port_dscp.values()) if self.dscp == "from-tc" else {self.dscp}


def load_profile(name_or_path: str) -> TrimProfile:
    """A profile by path, or by name: NAME.yml in TRIMLAB_PROFILES' folders, then the
    packaged switch_configs/profiles."""
    path = Path(name_or_path)
    if not path.suffix:
        dirs = resources.profile_dirs()
        path = next((d / f"{name_or_path}.yml" for d in dirs if (d / f"{name_or_path}.yml").exists()),
                    dirs[-1] / f"{name_or_path}.yml")
    if not path.exists():
        known = ", ".join(sorted({p.stem for d in resources.profile_dirs() for p in d.glob("*.yml")}))
        raise SpecError(f"profile {name_or_path!r} not found; profiles: {known} "
                        "(add folders of your own with TRIMLAB_PROFILES)")
    data = read_yaml(path, "profile") or {}
    try:
        return validated(TrimProfile, data)
    except SpecError as exc:
        raise SpecError(f"profile {path.stem}: {exc}") from None


# -- experiment specs ----------------------------------------------------------------------

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


RATE_PATTERN = r"^\d+(\.\d+)?\s*[kmgKMG]?(bit|bps|b)?$"


class FabricSpec(_Strict):
    """A routed leaf–spine fabric instead of one switch (`trimlab rack up --leaves --spines`)."""

    leaves: int = Field(2, ge=2, le=4, description="leaf switches; hosts spread over them")
    spines: int = Field(1, ge=1, le=4, description="spine switches; every leaf has an uplink to each")
    uplink_rate: str | None = Field(None, pattern=RATE_PATTERN,
                                    description="leaf–spine link rate (default: the port rate)")


class VirtualRackSpec(_Strict):
    workers: int = Field(4, ge=1, le=32, description="worker hosts")
    traffic_hosts: int = Field(1, ge=0, le=2, description="hosts that send the background flows")
    rate: str = Field("1gbit", pattern=RATE_PATTERN, description="every data port's rate, e.g. 100mbit")
    mtu: int = Field(1500, ge=1280, le=9000, description="the data network's MTU")
    buffer_bytes: int = Field(65536, ge=0, description="byte budget of each switch queue")
    fabric: FabricSpec | None = Field(None, description="leaves, spines, uplink_rate: a leaf–spine fabric")
    platform: str = Field(platforms.VIRTUAL_DEFAULT, description="the switch platform every virtual switch emulates "
                                               "(`trimlab platforms`; ideal: rewrites every length and checksum)")
    switch_platforms: dict[str, str] = Field(default_factory=dict, description="a switch (sw, leaf1, spine1...) "
                                             "that emulates another platform")

    @model_validator(mode="after")
    def _platforms(self):
        platforms.get(self.platform, "rack.virtual.platform")
        for sw, name in self.switch_platforms.items():
            platforms.get(name, f"rack.virtual.switch_platforms.{sw}")
        return self

    def platform_names(self) -> set[str]:
        return {self.platform, *self.switch_platforms.values()}


class RackSpec(_Strict):
    virtual: VirtualRackSpec | None = Field(default_factory=VirtualRackSpec, description="a virtual rack "
                                            "brought up for the run (the default)")
    inventory: str | None = Field(None, description="a lab inventory instead of the virtual rack")

    @model_validator(mode="after")
    def _one(self):
        if self.inventory:
            self.virtual = None
        return self


class CodecSpec(_Strict):
    name: CodecName = Field("embedded", description="how gradients are encoded into packets")
    params: dict[str, Any] = Field(default_factory=dict, description="the codec's parameters, e.g. planes: 16")
    span: int = Field(4096, ge=32, le=1 << 20, description="coordinates rotated together (a power of two)")
    coords: int | None = Field(None, description="coordinates per packet (default: fill the MTU)")

    @model_validator(mode="after")
    def _check(self):
        from trimlab.codec import get_codec  # heavy (torch): the CLI starts without it
        if self.span & (self.span - 1):
            raise SpecError(f"codec.span={self.span}: must be a power of two (32..1048576)")
        if self.coords is not None and (self.coords <= 0 or self.coords % 32):
            raise SpecError(f"codec.coords={self.coords}: must be a positive multiple of 32")
        try:
            get_codec(self.name, **self.params)
        except CodecError as exc:
            raise SpecError(f"codec.params: {exc}") from None
        return self


class TransportSpec(_Strict):
    dscp: int = Field(10, ge=0, le=63, description="DSCP of gradient packets (trimmable)")
    control_dscp: int = Field(46, ge=0, le=63, description="DSCP of parameters (not trimmable)")
    deadline_ms: float = Field(200.0, gt=0, le=60_000, description="how long a receiver waits for a step's packets")
    pacing: str | None = Field(None, pattern=r"^\d+(\.\d+)?\s*[kmgKMG]?(bit|bps|b)?$",
                               description="pace each sender to this rate (default: as fast as the NIC)")
    port: int = Field(GRADIENT_PORT, ge=1024, le=65535, description="UDP port of gradients (parameters: port + 1)")
    ipv6: bool = Field(False, description="the data network's IPv6 addresses instead of IPv4")

    @model_validator(mode="after")
    def _classes(self):
        if self.dscp == self.control_dscp:
            raise SpecError(f"transport.control_dscp={self.control_dscp}: must differ from "
                            "transport.dscp, or parameters would be trimmed too")
        return self


class BackgroundFlow(_Strict):
    rate: str = Field(pattern=r"^\d+(\.\d+)?\s*[kmgKMG]?(bit|bps|b)?$", description="the rate asked (checked against "
                      "what the sender delivered)")
    dscp: int | Literal["gradients"] = Field(0, description="its class (0..63): the same as gradients' to congest "
                                             "their queue; `gradients`: whichever class the run's gradients "
                                             "take (transport.dscp, or 0 under workload.comm gloo)")
    protocol: Literal["udp", "tcp"] = "udp"
    pattern: Literal["constant", "on_off"] = Field("constant", description="on_off: on_ms sending, off_ms silent")
    on_ms: float = Field(100.0, gt=0)
    off_ms: float = Field(100.0, ge=0)


class CongestionSpec(_Strict):
    incast: bool = Field(True, description="every worker sends to one receiver at once")
    background: list[BackgroundFlow] = Field(default_factory=list, description="flows from the traffic hosts into "
                                             "the first worker's port")
    inject_probability: float = Field(0.0, ge=0.0, le=1.0, description="the virtual switch trims or drops this "
                                      "fraction of eligible packets whatever the load")
    inject_action: Literal["trim", "drop"] = "trim"


class CaptureSpec(_Strict):
    points: list[Literal["workers", "ps", "switch"]] = Field(default_factory=lambda: ["workers", "ps"],
                                                             description="where tcpdump captures")
    sender_snaplen: int = Field(128, ge=64, le=65535, description="bytes kept of each packet at the senders")


class TruthSpec(_Strict):
    every: int = Field(10, ge=1, description="save the exact gradient every N steps")


SWEEPABLE = ("seed", "topology", "profile", "codec.name", "codec.params", "workload.lr", "workload.batch",
             "workload.comm", "workload.data", "workload.model",
             "transport.dscp", "transport.pacing", "congestion.incast", "congestion.inject_probability",
             "congestion.inject_action", "rack.virtual.rate", "rack.virtual.buffer_bytes", "rack.virtual.platform")


class ExperimentSpec(_Strict):
    """One experiment: everything a run needs, validated before the rack is touched."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description="names the run directory")
    seed: int = Field(0, ge=0, lt=1 << 32, description="model, data order and codec randomness")
    job: int = Field(1, ge=0, lt=1 << 16, description="in every packet's header: receivers take only their own")
    topology: Literal["ps", "sharded"] = Field("ps", description="ps: N workers → 1 ps (incast); "
                                               "sharded: each worker owns 1/N of the gradient")
    rack: RackSpec = Field(default_factory=RackSpec, description="where it runs")
    profile: str = Field("default", description="the trimming profile (switch_configs/profiles, TRIMLAB_PROFILES)")
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    codec: CodecSpec = Field(default_factory=CodecSpec)
    transport: TransportSpec = Field(default_factory=TransportSpec)
    congestion: CongestionSpec = Field(default_factory=CongestionSpec)
    capture: CaptureSpec = Field(default_factory=CaptureSpec)
    truth: TruthSpec = Field(default_factory=TruthSpec)
    sweep: dict[str, list[Any]] = Field(default_factory=dict, description="key path -> values: one run per "
                                        "combination of them (the keys are listed below the table)")
    target_accuracy: float | None = Field(None, gt=0, le=1, description="the test accuracy comparisons time "
                                          "runs to (default: 95 % of the best final accuracy among them)")
    seeds: list[int] = Field(default_factory=list, description="repeat every point with each of these seeds "
                             "(runs named POINT-s<seed>; comparisons report mean and 95 % interval)")
    extra_points: list[dict[str, Any]] = Field(
        default_factory=list, description="points run after the sweep's product: each maps key paths "
                                          "to values, applied to this spec")
    contenders: list[dict[str, Any]] = Field(
        default_factory=list, description="what competes at every point: each maps key paths to values, "
                                          "applied before the point's own; every point runs once per contender")

    @model_validator(mode="after")
    def _check(self):
        if self.seeds and "seed" in self.sweep:
            raise SpecError("seeds: the spec sweeps seed too; give the seeds in one place (seeds: [...])")
        if len(set(self.seeds)) != len(self.seeds):
            raise SpecError(f"seeds: {self.seeds} repeats a seed")
        for s in self.seeds:
            if not 0 <= s < 1 << 32:
                raise SpecError(f"seeds: {s} is not a seed (0..2^32-1)")
        for key, values in self.sweep.items():
            if key not in SWEEPABLE:
                raise SpecError(f"sweep.{key}: cannot be swept; sweepable keys: {', '.join(SWEEPABLE)}")
            if not values:
                raise SpecError(f"sweep.{key}: give at least one value")
        profile = load_profile(self.profile)  # a missing profile is an error now, not later
        t = self.transport
        if profile.tc_of(t.dscp) not in profile.eligible_queues:
            raise SpecError(f"transport.dscp={t.dscp}: maps to queue {profile.tc_of(t.dscp)}, which "
                            f"profile {profile.name} does not trim (eligible_queues "
                            f"{profile.eligible_queues}); pick a DSCP of those queues")
        if profile.tc_of(t.control_dscp) in profile.eligible_queues:
            raise SpecError(f"transport.control_dscp={t.control_dscp}: maps to trimmable queue "
                            f"{profile.tc_of(t.control_dscp)} of profile {profile.name}; parameters "
                            "must travel on a queue that is not trimmed")
        if self.congestion.background and self.rack.virtual and not self.rack.virtual.traffic_hosts:
            raise SpecError("congestion.background: needs rack.virtual.traffic_hosts >= 1 (the host "
                            "that sends the flows)")
        gloo = self.workload.kind == "ddp" and self.workload.comm == "gloo"
        for i, f in enumerate(self.congestion.background):
            if f.dscp != "gradients" and not 0 <= f.dscp <= 63:
                raise SpecError(f"congestion.background.{i}.dscp={f.dscp}: a DSCP is 0..63, or 'gradients'")
        if gloo and self.congestion.inject_probability and self.congestion.inject_action == "trim":
            raise SpecError("congestion.inject_action=trim: gloo's TCP segments cannot be trimmed usefully (the "
                            "receiver's kernel drops a cut segment); inject drops for workload.comm=gloo")
        if self.workload.kind == "ddp" and self.topology != "sharded":
            raise SpecError("workload.kind=ddp: set topology: sharded (the DDP hook reduce-scatters every "
                            "bucket among the workers; there is no ps)")
        if self.topology == "sharded" and self.rack.virtual and self.rack.virtual.workers < 2:
            raise SpecError("topology=sharded: needs rack.virtual.workers >= 2")
        return self

    def flow_dscp(self, flow: BackgroundFlow) -> int:
        """A background flow's DSCP (`gradients`: the class this run's gradients take)."""
        if flow.dscp != "gradients":
            return flow.dscp
        return 0 if self.workload.kind == "ddp" and self.workload.comm == "gloo" else self.transport.dscp

    def points(self) -> list["ExperimentSpec"]:
        """The sweep's cartesian product then the extra points, each once per contender of
        `contenders` and per seed of `seeds`, one validated spec each (the spec itself if
        there is none of these)."""
        if not self.sweep and not self.extra_points and not self.seeds and not self.contenders:
            return [self]
        base = self.model_dump(exclude={"sweep", "extra_points", "seeds", "contenders"})
        keys = list(self.sweep)
        combos = [dict(zip(keys, combo)) for combo in itertools.product(*(self.sweep[k] for k in keys))] \
            if keys else [{}]
        places = [f"sweep point {j}" for j in range(len(combos))] + \
                 [f"extra_points[{j}]" for j in range(len(self.extra_points))]
        # contenders side by side at each point: they meet the host in the same state
        runs = [(w, c, ch) for w, ch in zip(places, combos + self.extra_points)
                for c in (range(len(self.contenders)) if self.contenders else [None])]
        out = []
        for i, (point, c, own) in enumerate(runs):
            changes = (self.contenders[c] if c is not None else {}) | own
            where = point if c is None else f"{point}, contenders[{c}]"
            data = copy.deepcopy(base)
            for k, v in changes.items():
                try:
                    set_path(data, k, v)
                except SpecError as exc:
                    raise SpecError(f"{where}: {exc}") from None
            label = "-".join(f"{k.split('.')[-1]}_{_label(v)}" for k, v in own.items()) or "base"
            if c is not None:  # the contender by its index: the point's own label must fit the name
                label = f"c{c}-{label}"
            name = re.sub(r"[^A-Za-z0-9_.-]", "_", f"{self.name}-{i:03d}-{label}")[:64 - (12 if self.seeds else 0)]
            for seed in self.seeds or [None]:
                one = copy.deepcopy(data)
                one["name"] = name if seed is None else f"{name}-s{seed}"
                if seed is not None:
                    one["seed"] = seed
                try:
                    out.append(validated(ExperimentSpec, one))
                except SpecError as exc:
                    raise SpecError(f"{where} ({label}): {exc}") from None
        return out


def _label(v) -> str:
    if isinstance(v, dict):
        return "_".join(f"{k}{w}" for k, w in v.items())
    if isinstance(v, list):  # e.g. background flows: their rates
        return "+".join(str(x.get("rate", len(x))) if isinstance(x, dict) else str(x) for x in v) or "none"
    return str(v)


def set_path(data: dict, path: str, value) -> None:
    """data['a']['b'] = value for path 'a.b'; a missing level is an error naming the path."""
    keys = path.split(".")
    node = data
    for i, k in enumerate(keys[:-1]):
        if not isinstance(node.get(k), dict):
            if node.get(k) is None and k in node:
                node[k] = {}
            else:
                raise SpecError(f"{'.'.join(keys[:i + 1])}: no such section")
        node = node[k]
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """--set key.path=value; the value is read as YAML (numbers, booleans, lists)."""
    key, sep, raw = item.partition("=")
    if not sep or not key:
        raise SpecError(f"--set {item!r}: use key.path=value, e.g. --set workload.steps=50")
    try:
        return key.strip(), yaml.safe_load(raw)
    except yaml.YAMLError:
        return key.strip(), raw


def find_experiment(path: str) -> Path:
    """A spec file: the path as given, else by name (`default`, `default.yaml` or
    `experiments/default.yaml`) in TRIMLAB_EXPERIMENTS' folders, then the packaged ones."""
    given = Path(path)
    if given.is_file():
        return given
    name = given.name if given.suffix else f"{given.name}.yaml"
    for d in resources.experiment_dirs():
        if (d / name).is_file():
            return d / name
    return given  # read_yaml names it: no such file


def load_experiment(path: str, overrides: list[str] = ()) -> ExperimentSpec:
    """Read a YAML spec, apply --set overrides, validate (SpecError names the key path)."""
    data = read_yaml(find_experiment(path), "spec")
    if not isinstance(data, dict):
        raise SpecError(f"{path}: a spec is a YAML mapping (name: ..., workload: ..., ...)")
    for item in overrides:
        key, value = parse_override(item)
        set_path(data, key, value)
    return validated(ExperimentSpec, data)
