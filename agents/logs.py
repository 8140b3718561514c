"""What agents write while they run: JSON event lines on stdout (the controller's progress
view reads them) and CSV files flushed as they go (a killed agent keeps what it wrote)."""

from __future__ import annotations

import csv
import json
import queue
import signal
import sys
import threading
from pathlib import Path

from trimlab.config import PACKET_LOG_FIELDS


def log_event(**fields) -> None:
    """One JSON line on stdout: the controller reads these for its progress view."""
    print(json.dumps(fields, separators=(",", ":")), flush=True)


def install_signal_exit() -> None:
    """SIGTERM ends the agent through its `finally` blocks (logs flushed, files closed)."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


class PacketLog:
    """packets.csv: one row per gradient datagram received, with how it was handled.
    A thread of its own formats and writes, off the step's critical path."""

    def __init__(self, path: Path):
        self.f = open(path, "w", newline="")
        self.w = csv.writer(self.f)
        self.w.writerow(PACKET_LOG_FIELDS)
        self.queue: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="packet-log", daemon=True)
        self.thread.start()

    def write(self, columns: dict) -> None:
        """Queue a batch of rows: PACKET_LOG_FIELDS -> equal-length arrays."""
        if columns and len(columns[PACKET_LOG_FIELDS[0]]):
            self.queue.put(columns)

    def _run(self) -> None:
        while (cols := self.queue.get()) is not None:
            self.w.writerows(zip(*(cols[k].tolist() for k in PACKET_LOG_FIELDS)))
            self.f.flush()  # a killed agent keeps what it wrote

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        self.f.close()


class MetricsLog:
    """A CSV with a fixed header, flushed every row (a killed agent keeps what it wrote)."""

    def __init__(self, path: Path, fields: tuple[str, ...]):
        self.fields = fields
        self.f = open(path, "w", newline="")
        self.w = csv.DictWriter(self.f, fields)
        self.w.writeheader()

    def write(self, **row) -> None:
        self.w.writerow(row)
        self.f.flush()

    def close(self) -> None:
        self.f.close()
