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

from tests.rack.conftest import ROOT, host

RATE = 20e6
PORT = 48000


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
    done = threading.Event()

    def stall():  # the stalls themselves are the experiment: 60 ms stopped, 40 ms running
        while not done.is_set():
            send.send_signal(signal.SIGSTOP)
            time.sleep(0.06)
            send.send_signal(signal.SIGCONT)
            done.wait(0.04)

    t = threading.Thread(target=stall, daemon=True)
    t.start()
    try:
        out, err = send.communicate(timeout=120)
    finally:
        done.set()
        t.join()
        if send.poll() is None:
            send.send_signal(signal.SIGCONT)
            send.kill()
            send.wait()
    assert send.returncode == 0, err[-2000:]
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
