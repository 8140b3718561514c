"""The trimlab header as a scapy layer, declared from trimlab.wire.HEADER_FIELDS.

    from scapy.layers.inet import IP, UDP
    from trimlab.scapy_layer import TrimGrad
    pkt = IP(raw_bytes)              # UDP port 47000 dissects as TrimGrad + Raw body
    pkt[TrimGrad].planes, pkt[TrimGrad].step

For declaring, building and dissecting packets in tests and when debugging; bulk parsing
of captures uses numpy (analysis), not scapy.
"""

from __future__ import annotations

from scapy.fields import BitField, ByteField, IEEEFloatField, IntField, ShortField
from scapy.layers.inet import UDP
from scapy.packet import Packet, bind_layers

from trimlab import wire
from trimlab.config import GRADIENT_PORT

_DEFAULTS = {"magic": wire.MAGIC, "version": wire.VERSION, "length": None, "scale": 1.0}


def _field(name: str, width):
    default = _DEFAULTS.get(name, 0)
    if width == "f32":
        return IEEEFloatField(name, default)
    if width in (8, 16, 32):
        return {8: ByteField, 16: ShortField, 32: IntField}[width](name, default)
    return BitField(name, default, width)


class TrimGrad(Packet):
    """A trimlab gradient packet header; the codec body follows as the payload."""

    name = "TrimGrad"
    fields_desc = [_field(name, width) for name, width in wire.HEADER_FIELDS]

    def post_build(self, pkt: bytes, pay: bytes) -> bytes:
        # `length` left unset means "as built": header plus body, like an untrimmed send.
        if self.length is None:
            at = wire.HEADER_DTYPE.fields["length"][1]
            pkt = pkt[:at] + (len(pkt) + len(pay)).to_bytes(2, "big") + pkt[at + 2:]
        return pkt + pay

    def mysummary(self) -> str:
        return self.sprintf("TrimGrad job=%job% step=%step% rank=%rank% span=%span% "
                            "packet=%packet% B=%coords% len=%length%")


bind_layers(UDP, TrimGrad, dport=GRADIENT_PORT)
