"""The native CPU kernels of the codecs (kernels.c), through ctypes.

C rather than torch because the codec's inner loop is one pass per span in cache (sign
flip, 12 butterfly stages, a per-packet norm, quantization, plane packing), which torch
runs as a dozen full-tensor passes with temporaries; C rather than numba because the
project already builds small C helpers with trimlab.native and numba would add a large
dependency to every NIC host. The kernels put the same bytes on the wire as the torch
reference (tests/unit/test_codec_native.py): both follow the arithmetic defined in
kernels.c's header.

`TRIMLAB_CODEC_IMPL=torch` turns the kernels off (`native` makes their absence an
error); `TRIMLAB_CODEC_THREADS` or set_threads() sets the threads per call (default 1).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

from trimlab import native, resources
from trimlab.errors import CodecError

_I64, _F, _P = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p


class _Job(ctypes.Structure):
    _fields_ = [
        ("codec", ctypes.c_int), ("rotated", ctypes.c_int), ("prescaled", ctypes.c_int),
        ("planes", ctypes.c_int), ("unbiased", ctypes.c_int),
        ("seed", ctypes.c_uint64), ("step", ctypes.c_uint64), ("bucket", ctypes.c_uint64),
        ("first_span", _I64), ("count", _I64), ("filled", _I64), ("size", _I64), ("coords", _I64),
        ("thresholds", _P), ("poly", _P), ("table", _P), ("fine", _P),
        ("x", _P), ("body", _P), ("width", _I64), ("stride", _I64), ("row_full", _I64), ("row_tail", _I64),
        ("scale", _P),
        ("slots", _P), ("length", _P), ("row_scale", _P), ("exps", _P), ("out", _P),
    ]


# the vector level (-march) is added by trimlab.native for the CPU that runs the kernels
FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math", "-shared", "-fPIC", "-pthread"]
_threads = int(os.environ.get("TRIMLAB_CODEC_THREADS", "1") or 1)


def set_threads(n: int) -> None:
    """Threads each encode or decode call may use (spans are split between them)."""
    global _threads
    if n < 1:
        raise CodecError(f"codec threads={n}: must be at least 1")
    _threads = int(n)


def mode() -> str:
    m = os.environ.get("TRIMLAB_CODEC_IMPL", "auto")
    if m not in ("auto", "native", "torch"):
        raise CodecError(f"TRIMLAB_CODEC_IMPL={m!r}: choose auto, native or torch")
    return m


def _lib():
    """The kernels for the level this CPU runs (or TRIMLAB_ISA's, where it asks for less)."""
    return _lib_for(os.environ.get("TRIMLAB_ISA", ""), os.environ.get("TRIMLAB_CPU_FEATURES_OFF", ""))


def isa() -> native.Isa:
    """The vector path the native kernels take on this host."""
    return native.ISAS[_lib()._trimlab_isa]


@functools.lru_cache(maxsize=None)
def _lib_for(cap: str, features_off: str):
    if sys.byteorder != "little":
        raise native.BuildError("the codec kernels need a little-endian host")
    lib, built = native.load_library(resources.c_source("codec", "kernels.c"), "codec", FLAGS,
                                     native.choose(cap=cap))
    lib._trimlab_isa = built.name
    for fn in (lib.tl_encode_group, lib.tl_decode_group):
        fn.argtypes, fn.restype = [ctypes.POINTER(_Job), ctypes.c_int], ctypes.c_int
    lib.tl_span_key.argtypes = [ctypes.c_uint64] * 4
    lib.tl_span_key.restype = ctypes.c_uint64
    if lib.tl_job_size() != ctypes.sizeof(_Job):
        raise native.BuildError("kernels.c's job_t and trimlab.codec.kernels._Job differ")
    return lib


def available() -> bool:
    try:
        _lib()
        return True
    except native.BuildError:
        return False


def implementation(codec, device: torch.device | str = "cpu") -> str:
    """'native' or 'torch': what encodes and decodes for `codec` on `device`."""
    m = mode()
    if not codec.native or torch.device(device).type != "cpu" or m == "torch":
        return "torch"
    if m == "native":
        _lib()  # raises BuildError, naming the missing compiler
        return "native"
    return "native" if available() else "torch"


def span_key(seed: int, step: int, bucket: int, span: int) -> int:
    return int(_lib().tl_span_key(seed, step, bucket, span))


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _job(codec, ctx, group, **kw) -> _Job:
    mask = (1 << 64) - 1
    return _Job(codec=codec.codec_id, rotated=int(codec.rotated), prescaled=int(codec.prescaled),
                planes=codec.planes, unbiased=int(codec.unbiased), seed=ctx.seed & mask,
                step=ctx.step & mask, bucket=ctx.bucket & mask, first_span=group.first, count=group.count,
                filled=group.filled, size=group.size, coords=ctx.coords, **kw)


def encode_groups(codec, flat: torch.Tensor, ctx, lay, body: torch.Tensor, scale: torch.Tensor) -> None:
    """Fill `body` (rows in the layout's block order; its rows may be strided, e.g. inside
    a frames array, its bytes contiguous) and `scale` from `flat` (float32)."""
    if body.stride(1) != 1:
        raise CodecError("codec kernel: body rows must be contiguous bytes")
    tables = codec.native_tables("cpu")
    row = 0
    for g in lay.groups:
        n_full, tail = divmod(g.size, lay.coords)
        job = _job(codec, ctx, g, x=flat.data_ptr() + 4 * g.start, body=body.data_ptr(), width=body.shape[1],
                   stride=body.stride(0), row_full=row, row_tail=row + g.count * n_full, scale=scale.data_ptr(),
                   **{k: _ptr(v) for k, v in tables.items()})
        if _lib().tl_encode_group(ctypes.byref(job), _threads):
            raise MemoryError("codec kernel: out of memory")
        row += g.count * (n_full + (tail > 0))


def decode_group(codec, ctx, group, body: torch.Tensor, slots: torch.Tensor, length: torch.Tensor,
                 row_scale: torch.Tensor, exps: torch.Tensor | None, out: torch.Tensor) -> None:
    """Decode the spans of `group` into `out` (the group's filled coordinates, contiguous):
    slots (count × packets per span) holds each packet's row in `body` or −1. A prescaled
    codec's `row_scale` is divided by 2^exps[span]; with exps None, the header scales as
    they came, and the kernel derives each span's exponent from those of its packets."""
    tables = codec.native_tables("cpu")
    job = _job(codec, ctx, group, body=body.data_ptr(), width=body.shape[1], stride=body.stride(0),
               slots=slots.data_ptr(),
               length=length.data_ptr(), row_scale=row_scale.data_ptr(), exps=_ptr(exps),
               out=out.data_ptr(), **{k: _ptr(v) for k, v in tables.items()})
    if _lib().tl_decode_group(ctypes.byref(job), _threads):
        raise MemoryError("codec kernel: out of memory")
