"""What the kernel says about this machine's sockets (/proc/net): the events tests wait
for instead of sleeping — a socket bound, a receive queue drained."""

from __future__ import annotations

import time
from pathlib import Path


def rx_queues(port: int, protocol: str = "udp") -> list[int]:
    """The receive queues (bytes not yet read) of every socket bound to local `port`."""
    out = []
    for table in (f"/proc/net/{protocol}", f"/proc/net/{protocol}6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                out.append(int(fields[4].split(":")[1], 16))
    return out


def wait_until(predicate, what: str, limit: float = 60.0):
    """Poll for the event; the limit only stops a hung test."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        got = predicate()
        if got:
            return got
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")
