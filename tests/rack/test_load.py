"""Background load that holds its rate on a busy host. The sender is stalled by
construction — stopped (SIGSTOP) 60 ms of every 100 ms, as a host whose cores are taken by
trainers and the switch stalls it — so the result does not depend on this machine's speed.
Paced in user space alone a flow can make up only 20 ms a stall (its burst bound, kept
small because its catch-up leaves back to back) and falls short; shaped in the kernel (an
htb class of its own on the host NIC, the virtual rack's way) its backlog leaves at the
rate while the sender is stopped, and the flow holds its rate."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.rack.conftest import ROOT, Capture, host
from trimlab.config import GRADIENT_PORT

RATE = 20e6
PORT = 48000


def stalled(proc: subprocess.Popen) -> str:
    """Run `proc` to its end, stopped 60 ms of every 100 ms (the stalls are the experiment);
    its stdout."""
    done = threading.Event()

    def stall():
        while not done.is_set():
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.06)
            proc.send_signal(signal.SIGCONT)
            done.wait(0.04)

    t = threading.Thread(target=stall, daemon=True)
    t.start()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        done.set()
        t.join()
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-2000:]
    return out


def flow(st, kernel_shaping: bool, seconds: float = 4.0) -> tuple[dict, int]:
    """One flow tr1 -> ps1 under stalls: the sender's summary and the bytes the sink got."""
    ps, tr = host(st, "ps1"), host(st, "tr1")

    def agent(h, *args):
        return subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable, "-m", "trimlab.agents.traffic", *args],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    sink = agent(ps, "sink", "--bind", ps.data_ipv4, "--port", str(PORT))
    assert '"listening"' in sink.stdout.readline()
    send = agent(tr, "send", "--dst", ps.data_ipv4, "--port", str(PORT), "--rate", str(int(RATE)),
                 "--duration", str(seconds), *(["--kernel-shaping"] if kernel_shaping else []))
    assert '"on"' in send.stdout.readline()  # sending
    out = stalled(send)
    # the sink reads what is still in flight, then stops (its socket drained)
    from tests.procnet import rx_queues, wait_until
    wait_until(lambda: not any(rx_queues(PORT)), "the sink has read everything")
    sink.send_signal(signal.SIGTERM)
    sout, _ = sink.communicate(timeout=30)
    return json.loads(out.strip().splitlines()[-1]), json.loads(sout.strip().splitlines()[-1])["bytes"]


@pytest.fixture(scope="module")
def rack(rack_factory):
    return rack_factory(workers=1, ps=1, traffic=1, rate="1gbit")


def test_a_stalled_flow_holds_its_rate_when_the_kernel_shapes_it(rack):
    summary, got = flow(rack, kernel_shaping=True)
    assert summary["paced_by"].startswith("htb 1:"), summary
    assert summary["offered_bps"] >= 0.97 * RATE, summary  # the run's 3 % tolerance
    assert summary["offered_bps"] <= 1.001 * RATE, summary  # and never above what was asked
    # what left the host is what arrived (nothing is congested here): the sink agrees
    assert got == summary["bytes"], (got, summary)
    shaped = subprocess.run(["ip", "netns", "exec", host(rack, "tr1").ns, "tc", "class", "show", "dev", "eth1"],
                            capture_output=True, text=True).stdout
    assert f"1:{PORT:x} " not in shaped  # the flow's class went with it


def test_a_stalled_flow_paced_in_user_space_alone_falls_short_and_says_so(rack):
    summary, got = flow(rack, kernel_shaping=False)
    assert summary["paced_by"] == "user space"
    assert summary["offered_bps"] < 0.9 * RATE, summary  # 40 ms running + 20 ms made up of each 100
    assert got == summary["bytes"]


def gradient_burst(st, kernel_shaping: bool) -> tuple[dict, float]:
    """The hook's sender (`transport.Sender`, paced to RATE) sending 3 s of datagrams w1 ->
    ps1 under the same stalls: its summary and the rate its packets left w1 at, from a
    capture of w1's port (first packet to last)."""
    w, ps = host(st, "w1"), host(st, "ps1")
    cap = Capture(st, "w1", f"udp dst port {GRADIENT_PORT}")
    try:
        proc = subprocess.Popen(["ip", "netns", "exec", w.ns, sys.executable, "-m", "trimlab.agents.transport", "send",
                                 "--dst", ps.data_ipv4, "--count", str(COUNT), "--size", str(SIZE),
                                 "--rate", str(int(RATE)), *(["--kernel-shaping"] if kernel_shaping else [])],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        summary = json.loads(stalled(proc).strip().splitlines()[-1])
    finally:
        frames = cap.stop()
    assert len(frames) == COUNT  # every datagram left (nothing is congested here)
    payload = SIZE * (len(frames) - 1)  # n packets span n - 1 gaps
    return summary, payload * 8 / float(frames[-1].time - frames[0].time)


COUNT, SIZE = 7500, 1000  # 3 s at RATE


def test_the_hooks_stalled_sender_holds_its_pacing_rate_when_the_kernel_shapes_it(rack):
    summary, rate = gradient_burst(rack, kernel_shaping=True)
    assert summary["paced_by"] == "htb 1:100", summary
    assert 0.97 * RATE <= rate <= 1.01 * RATE, rate
    shaped = subprocess.run(["ip", "netns", "exec", host(rack, "w1").ns, "tc", "class", "show", "dev", "eth1"],
                            capture_output=True, text=True).stdout
    assert "1:100 " not in shaped  # the class went once its backlog had left


def test_the_hooks_stalled_sender_paced_in_user_space_falls_short(rack):
    summary, rate = gradient_burst(rack, kernel_shaping=False)
    assert summary["paced_by"] == "user space"
    assert rate < 0.9 * RATE, rate  # 40 ms running + two packets made up of each 100
