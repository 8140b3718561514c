"""What a node's collaborators — the collectors, the reliable channel's broadcasts, failure
detection — need of their node, passed to them explicitly: the codec and its parameters,
the peers, the discard counters and the control socket's send. The node builds one and
owns what it refers to; the collaborators never see the node itself."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from trimlab.codec import Codec


@dataclass
class NodeContext:
    codec: Codec
    job: int
    seed: int
    span: int  # the rotation's span (coordinates)
    coords: int  # coordinates a packet carries
    mtu: int
    ipv6: bool
    peer_addrs: list[str]  # a datagram's peer index -> its address
    peer_index: Callable[[str], int]  # an address -> its peer index, -1 for none
    name_of: Callable[[str], str]  # an address -> "host (address)", for messages
    last_heard: dict[str, float]  # peer address -> when anything last came from it
    discarded: collections.Counter  # reason -> datagrams discarded
    send_control: Callable[[bytes, str], bool]  # a datagram to an address's control port; False: socket full
    unsent_control: Callable[[], int]  # bytes the control socket has not sent yet
    state: Callable[[], str]  # what is in flight, for error messages
