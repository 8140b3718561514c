"""Fixtures for tests that build real racks. Every rack a test builds is taken down in
a finalizer, also when the test fails."""

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def require_root():
    if os.geteuid() != 0:
        pytest.skip("needs root (CI runs as root)")


def new_id() -> str:
    return "t" + secrets.token_hex(2)


@pytest.fixture(scope="module")
def rack_factory():
    """rack_factory(**options) -> RackState; all of them go down at module end."""
    require_root()
    from trimlab.testbed.vrack import rack

    built = []

    def make(rack_id=None, workers=2, ps=1, traffic=0, rate="100mbit", mtu=1500, delay=0.0, **fabric):
        st = rack.plan(rack_id or new_id(), workers, ps, traffic, rate, mtu, delay, **fabric)
        built.append(st)
        return rack.up(st, owned=True)  # a killed test run leaves a stale rack: `rack down --stale`

    yield make
    for st in built:
        rack.down(st)


def ns_python(st, host: str, *args: str, **popen) -> subprocess.Popen:
    ns = next(h.ns for h in st.hosts if h.name == host)
    return subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "tests.rack.nsrun", *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def host(st, name):
    return next(h for h in st.hosts if h.name == name)


class Receiver:
    """A UDP receiver in a host namespace, ready before the senders start."""

    def __init__(self, st, name: str, v6: bool = False, port: int = 47001, idle: float = 1.5):
        ready = Path(f"/tmp/trimlab-test-ready-{os.getpid()}-{secrets.token_hex(3)}")
        self.sent = ready.with_name(ready.name.replace("ready", "sent"))
        self.proc = ns_python(st, name, "udp_receive", f"v6={'6' if v6 else '4'}", f"port={port}",
                              f"idle={idle}", f"ready={ready}", f"sent={self.sent}")
        deadline = time.monotonic() + 10
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"receiver did not start: {self.proc.stderr.read()}")
            time.sleep(0.02)
        ready.unlink()

    def result(self, timeout: float = 60):
        """What arrived, once the senders are done (the caller has sent everything)."""
        self.sent.touch()
        try:
            out, err = self.proc.communicate(timeout=timeout)
        finally:
            self.sent.unlink(missing_ok=True)
        assert self.proc.returncode == 0, err
        return [(int(h[:8], 16), int(h[8:16], 16), n, tos, h) for h, n, tos in json.loads(out)]

    def kill(self):
        self.sent.unlink(missing_ok=True)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Capture:
    """tcpdump on a host's data port; frames come back as scapy packets."""

    def __init__(self, st, name: str, bpf_filter: str = "udp or tcp", path: Path | None = None):
        self.path = path or Path(f"/tmp/trimlab-test-{os.getpid()}-{secrets.token_hex(3)}.pcap")
        self.proc = subprocess.Popen(["ip", "netns", "exec", host(st, name).ns, "tcpdump", "--immediate-mode", "-i", "eth1",
                                      "-n", "-U", "-s", "0", "-w", str(self.path), bpf_filter],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        line = self.proc.stderr.readline()  # "listening on eth1 ..." once the capture runs
        assert "listening" in line, line

    def stop(self):
        from scapy.utils import rdpcap
        time.sleep(0.3)
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=10)
        frames = list(rdpcap(str(self.path)))
        self.path.unlink(missing_ok=True)
        return frames
