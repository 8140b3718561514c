"""The true error a trim causes, packet by packet (for the analysis that matches each
trim to the error it caused): re-encode the bucket and decode each packet as it arrived."""

from __future__ import annotations

import torch

from trimlab.codec.base import Codec, CodecContext


def packet_errors(codec: Codec, x: torch.Tensor, ctx: CodecContext, span: torch.Tensor,
                  index: torch.Tensor, nbytes: torch.Tensor) -> dict[str, torch.Tensor]:
    """The true error of packets (span, index) of bucket `x` when `nbytes` of each body
    arrive (< 0: the packet was lost). Measured where the codec quantizes (after the
    rotation, which is orthonormal, so a span's error is the sum of its packets'):
    `error` = ‖ŷ − y‖², `energy` = ‖y‖², and the `scale` the encoder wrote in the header
    (for checking a re-encoding against the wire). NaN for a (span, index) the layout
    does not have."""
    n = span.shape[0]
    out = {k: torch.full((n,), float("nan"), dtype=torch.float64) for k in ("error", "energy", "scale")}
    span, index, nbytes = span.cpu().long(), index.cpu().long(), nbytes.cpu().long()
    for b, y, _, _, exp in codec.blocks(x, ctx):
        g = b.group
        rows = ((span >= g.first) & (span < g.first + g.count) & (index >= b.first_index)
                & (index < b.first_index + b.per_span)).nonzero().squeeze(1)
        if rows.numel() == 0:
            continue
        pos = ((span[rows] - g.first) * b.per_span + index[rows] - b.first_index).to(y.device)
        yb = y.index_select(0, pos)
        body, scale = codec.encode_block(yb)
        unit = torch.ldexp(torch.ones_like(scale, dtype=torch.float64), exp.index_select(0, pos))
        full = body.shape[1]
        got = nbytes[rows].to(y.device)
        keep = torch.arange(full, device=y.device)[None, :] < got.clamp(min=0)[:, None]
        yhat, _ = codec.decode_block(body * keep, got.clamp(min=0, max=full), scale)
        yhat = torch.where((got >= 0)[:, None], yhat, torch.zeros_like(yhat))
        out["error"][rows] = (((yhat - yb).double() ** 2).sum(1) * unit ** 2).cpu()
        out["energy"][rows] = ((yb.double() ** 2).sum(1) * unit ** 2).cpu()
        out["scale"][rows] = torch.ldexp(scale, exp.index_select(0, pos)).double().cpu()
    return out
