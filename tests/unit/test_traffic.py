"""Background flows on loopback: the sink receives what the sender sent, at about the rate
asked for, UDP and TCP, with on/off transitions reported."""

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.procnet import rx_queues, wait_until

ROOT = Path(__file__).resolve().parents[2]


def agent(*args):
    return subprocess.Popen([sys.executable, "-m", "trimlab.agents.traffic", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("protocol,port", [("udp", 48110), ("tcp", 48111)])
def test_flow_reaches_the_sink_at_its_rate(protocol, port):
    sink = agent("sink", "--bind", "127.0.30.2", "--port", str(port), "--protocol", protocol)
    try:
        assert '"listening"' in sink.stdout.readline()
        send = subprocess.run([sys.executable, "-m", "trimlab.agents.traffic", "send", "--dst", "127.0.30.2",
                               "--port", str(port), "--rate", "20mbit", "--protocol", protocol,
                               "--pattern", "on_off", "--on-ms", "100", "--off-ms", "100",
                               "--duration", "1.0"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert send.returncode == 0, send.stderr
        lines = [json.loads(x) for x in send.stdout.splitlines()]
        sent = lines[-1]["bytes"]
        events = [x["event"] for x in lines[:-1]]
        assert events.count("off") >= 4 and events.count("on") >= 4  # 100 ms on, 100 ms off
        # half the time on at 20 Mbit/s for 1 s: about 1.25 MB
        assert 0.6e6 < sent < 1.6e6
        # measured over the time it was on: never above the request (a burst of make-up at most)
        s = lines[-1]
        assert s["rate_bps"] == 20e6 and 0.4 < s["on_s"] < 0.75, s
        assert s["offered_bps"] == pytest.approx(sent * 8 / s["on_s"], rel=1e-4) and s["offered_bps"] <= 20e6 * 1.05
        wait_until(lambda: not any(rx_queues(port, protocol)), "the sink has read everything")
    finally:
        sink.send_signal(signal.SIGTERM)
        out, _ = sink.communicate(timeout=10)
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["bytes"] == sent
