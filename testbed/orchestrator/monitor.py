"""The agents of one run while they run: health (an essential agent that exits with an
error fails the run at once), readiness (captures and sinks listening) and training
progress, from the typed events of their output lines. No UI here: `progress` draws it."""

from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from trimlab import rundir
from trimlab.testbed import remote
from trimlab.errors import TrimlabError
from trimlab.testbed.orchestrator import events
from trimlab.testbed.orchestrator.placement import RunFailed

# DDP reports a comm hook's failed future as "Unable to cast <the hook's message> to Tensor"
_DDP_HOOK_ERROR = re.compile(r"Unable to cast (.*) to Tensor$")


def _unwrapped(line: str) -> str:
    """An agent's last log line, with the hook's own message out of DDP's wrapping."""
    return _DDP_HOOK_ERROR.sub(r"\1", line)


@dataclass
class Agent:
    host: str
    kind: str  # worker | ps | capture | traffic<i> | sink<i> | sampler
    proc: remote.RemoteProcess
    essential: bool  # its failure fails the run


@dataclass
class Training:
    """What the controller knows of training so far."""

    steps: int
    step: int = -1  # rank 0's last step
    loss: float | None = None
    trimmed: int = 0  # the ps's count so far
    acc: float | None = None
    script_results: dict[int, events.Done] = field(default_factory=dict)  # rank -> a DDP script's last line

    def on_event(self, ev: events.Event) -> None:
        if isinstance(ev, events.Done):
            if ev.rank is not None and ev.role is None:  # a DDP script's own result
                self.script_results[ev.rank] = ev
        elif isinstance(ev, events.Step):
            if ev.role == "ps":
                self.trimmed += ev.trimmed
                if ev.test_acc is not None:
                    self.acc = ev.test_acc
            elif ev.rank == 0:
                self.step, self.loss = ev.step, ev.loss


class Monitor:
    def __init__(self, logs: Path, steps: int):
        self.logs = logs
        self.agents: list[Agent] = []
        self.training = Training(steps)
        self.listening: dict[str, threading.Event] = {}

    def on_training_line(self, line: str) -> None:
        ev = events.parse(line)
        if ev is not None:
            self.training.on_event(ev)

    def readiness(self, key: str):
        """An output-line callback that marks `key` (\"what-host\") ready when it listens."""
        ready = self.listening[key] = threading.Event()

        def on_line(line: str) -> None:
            if isinstance(events.parse(line), events.Listening):
                ready.set()
        return on_line

    def wait_ready(self, what: str, timeout: float = 20.0) -> None:
        end = time.monotonic() + timeout
        for key, ready in self.listening.items():
            while not ready.wait(0.1):
                self.check()
                if time.monotonic() > end:
                    raise RunFailed(f"{key.split('-', 1)[1]}: {what} did not start within {timeout:g} s")
        self.listening.clear()

    def check(self) -> None:
        """A training or capture agent that exited with an error fails the run now."""
        for a in self.agents:
            if a.essential and not a.proc.running():
                rc = a.proc.wait(1)
                if rc != 0 or a.kind not in ("worker", "ps"):
                    log = self.logs / rundir.log_file(a.host, a.kind)
                    lines = [ln for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []
                    tail = [_unwrapped(lines[-1].removeprefix("[stderr] "))] if lines else []
                    if rc in (None, -1) and not a.proc.session.connected:
                        raise RunFailed(f"host {a.host}: lost its SSH connection while its {a.kind} ran "
                                        "(its sshd was killed, or the host went away)")
                    how = f"exited {rc}" if rc not in (None, -1) else "was killed"
                    raise RunFailed(f"host {a.host}: {a.kind} {how}" + (f": {tail[0]}" if tail else ""))

    def wait_training(self, budget_s: float, t0: float, view) -> None:
        """Until every worker and ps exited (RunFailed past `budget_s` from `t0`);
        `view(training)` is called a few times a second."""
        trainers = [a for a in self.agents if a.kind in ("worker", "ps")]
        while any(a.proc.running() for a in trainers):
            self.check()
            if time.monotonic() - t0 > budget_s:
                raise RunFailed(f"training did not finish within {budget_s:.0f} s")
            view(self.training)
            time.sleep(0.2)
        self.check()

    def stop(self) -> None:
        """Stop every agent still running: idempotent, never raises."""
        for a in reversed(self.agents):
            try:
                a.proc.stop()
            except (TrimlabError, OSError, EOFError):
                pass
