"""Provision a virtual rack through the same playbooks and SSH path a lab rack uses:
first run changes, second run changed=0, --check changes nothing, unreachable hosts are
named within a bounded time."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from tests.rack.conftest import host

CLI = [sys.executable, "-m", "trimlab.testbed.cli"]


@pytest.fixture(scope="module")
def prack(rack_factory):
    return rack_factory(workers=2, ps=1, traffic=0, rate="100mbit")


def run(st, profile, check=False):
    from trimlab.testbed import provision as prov
    return prov.run(st.dir / "inventory.yml", profile=profile, check=check)


def show(st):
    out = subprocess.run(CLI + ["switch", "show", "--id", st.id], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_first_run_changes_second_run_changes_nothing(prack):
    first = run(prack, "sonic-default")
    assert first.status == "successful" and not first.failures, first.failures
    assert any(c["host"] == prack.switch.ns for c in first.changes)  # the profile was applied
    assert set(first.hosts) == {h.ns for h in prack.hosts}
    second = run(prack, "sonic-default")
    assert second.status == "successful" and second.changed == 0, second.changes
    running = show(prack)
    assert running["SWITCH_TRIMMING"]["GLOBAL"] == {"size": "128", "dscp_value": "48", "queue_index": "6"}
    port = prack.ports[0]
    trim_q = running["BUFFER_QUEUE"][f"{port}|3"]["profile"]
    assert running["BUFFER_PROFILE"][trim_q]["packet_discard_action"] == "trim"


def test_check_mode_changes_nothing_but_says_what_would(prack):
    run(prack, "sonic-default")
    before = show(prack)
    out = subprocess.run(CLI + ["provision", "--id", prack.id, "--profile", "cumulus-default", "--check"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"changed: {prack.switch.ns}: Apply the Config DB fragment" in out.stdout
    assert show(prack) == before


def test_a_missing_data_interface_is_named_with_its_fix(prack, tmp_path):
    from trimlab.testbed import provision as prov
    inventory = yaml.safe_load((prack.dir / "inventory.yml").read_text())
    w1 = host(prack, "w1").ns
    inventory["all"]["children"]["nic_hosts"]["hosts"][w1]["data_if"] = "eth9"
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inventory))
    out = prov.run(path, profile="sonic-default", limit=w1, tags="nic_host")
    assert out.rc != 0 and [(f["host"], f["msg"]) for f in out.failures] == [
        (w1, f"{w1}: data interface eth9 not found; fix data_if in the inventory")]


def test_unreachable_host_is_named_within_a_bounded_time(prack):
    w2 = host(prack, "w2")
    pid = int((prack.dir / "run" / "sshd_w2.pid").read_text())
    os.kill(pid, signal.SIGTERM)
    try:
        t0 = time.monotonic()
        out = subprocess.run(CLI + ["provision", "--id", prack.id, "--profile", "sonic-default"],
                             capture_output=True, text=True, timeout=300)
        elapsed = time.monotonic() - t0
        assert out.returncode == 1
        assert f"failed: {w2.ns}:" in out.stderr and "unreachable" in out.stderr
        assert elapsed < 120  # ConnectTimeout bounds it; the other hosts still ran
        assert f"{host(prack, 'w1').ns}" in out.stdout
    finally:
        from trimlab.testbed.vrack.rack import _run, _sshd_config
        _run("/usr/sbin/sshd", "-f", str(_sshd_config(prack, w2)), ns=w2.ns)
