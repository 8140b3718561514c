"""Specs and their validation (pydantic). Every error names the field and what to do.

For now: the trim plan — what survives a trim of size S for a given MTU, B and codec.
The experiment spec and the switch profiles join this module with the issues that use them.
"""

from __future__ import annotations

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
