"""Trimmable gradient encodings: pure tensor code, no I/O, CPU and CUDA.

    codec = get_codec("embedded", planes=16)
    packets = codec.encode(grad, CodecContext(seed=1, step=7, bucket=0))
    decoded = codec.decode(packets.truncated(40), ctx, grad.numel())
"""

from __future__ import annotations

import inspect

from trimlab.codec.base import Codec, CodecContext, Decoded, Packets
from trimlab.codec.embedded import Embedded
from trimlab.codec.layout import Layout
from trimlab.codec.raw import BF16, FP32
from trimlab.codec.sign_tail import SignTail
from trimlab.errors import CodecError

CODECS: dict[str, type[Codec]] = {c.name: c for c in (Embedded, SignTail, FP32, BF16)}
BY_ID: dict[int, type[Codec]] = {c.codec_id: c for c in CODECS.values()}
DEFAULT_CODEC = "embedded"


def get_codec(name: str = DEFAULT_CODEC, **params) -> Codec:
    """A codec by name; unknown names and parameters are a CodecError naming the choices."""
    try:
        cls = CODECS[name]
    except KeyError:
        raise CodecError(f"codec {name!r} is unknown; choose one of {', '.join(CODECS)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        allowed = ", ".join(p for p in inspect.signature(cls).parameters) or "none"
        raise CodecError(f"codec {name!r}: {exc}; its parameters are: {allowed}") from None


__all__ = ["BY_ID", "CODECS", "Codec", "CodecContext", "CodecError", "Decoded", "Layout",
           "Packets", "get_codec"]
