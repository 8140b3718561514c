"""Specs and their validation (pydantic). Every error names the field and what to do.

For now: the trim plan — what survives a trim of size S for a given MTU, B and codec.
The experiment spec and the switch profiles join this module with the issues that use them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from testbed import wire
from testbed.errors import SpecError

CodecName = Literal["embedded", "sign_tail", "fp32", "bf16"]


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
    coords: int | None = Field(None, description="coordinates per packet B (default: fill the MTU)")
    codec: CodecName = "embedded"
    codec_params: dict[str, Any] = Field(default_factory=dict)
    ipv6: bool = False

    @model_validator(mode="after")
    def _check(self):
        from testbed.codec import get_codec

        # SpecError (not ValueError) passes through pydantic, keeping the field's name.
        if self.ipv6 and self.mtu < 1280:
            raise SpecError(f"mtu={self.mtu}: IPv6 needs an MTU of at least 1280")
        floor = wire.min_trim_size(self.ipv6)
        if self.trim_size < floor:
            raise SpecError(f"trim_size={self.trim_size}: cannot keep the {wire.HEADER_LEN}-byte "
                             f"trimlab header over {'IPv6' if self.ipv6 else 'IPv4'}/UDP: "
                             f"use at least {floor}")
        codec = get_codec(self.codec, **self.codec_params)
        best = wire.max_coords(codec, self.mtu, self.ipv6)
        if self.coords is None:
            self.coords = best
        elif self.coords % 32 or self.coords <= 0:
            raise SpecError(f"coords={self.coords}: B must be a positive multiple of 32")
        elif self.coords > best:
            raise SpecError(f"coords={self.coords}: does not fit mtu={self.mtu} with codec "
                             f"{self.codec}: at most {best}")
        return self

    def figures(self) -> dict[str, Any]:
        """The plan's numbers: sizes, bits per coordinate kept, expected NMSE."""
        import torch

        from testbed.codec import get_codec

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
        }


# -- trimming profiles ---------------------------------------------------------------------

PROFILES_DIR = Path(__file__).resolve().parent.parent / "switch_configs" / "profiles"


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
        import ipaddress
        for src in self.exempt_sources:
            try:
                ipaddress.ip_network(src)
            except ValueError:
                raise SpecError(f"exempt_sources: {src!r} is not an IP prefix (e.g. 198.19.0.13/32)") from None
        return self

    def tc_of(self, dscp: int) -> int:
        """Traffic class of a DSCP: the profile's map (unmapped: 0), else DSCP >> 3."""
        return self.dscp_to_tc.get(dscp, 0) if self.dscp_to_tc is not None else dscp >> 3


def load_profile(name_or_path: str) -> TrimProfile:
    """A profile by name (switch_configs/profiles/NAME.yml) or path."""
    import yaml

    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILES_DIR / f"{name_or_path}.yml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILES_DIR.glob("*.yml")))
        raise SpecError(f"profile {name_or_path!r} not found; profiles: {known}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML ({exc})") from None
    try:
        return validated(TrimProfile, data)
    except SpecError as exc:
        raise SpecError(f"profile {path.stem}: {exc}") from None
