import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trimlab.testbed import inventory
from trimlab.errors import SpecError
from trimlab.testbed.provision import render_profiles

ROOT = Path(__file__).resolve().parents[2]
LAB = ROOT / "playbooks" / "inventories" / "lab.example.yml"


def test_lab_example_describes_a_real_rack():
    rack = inventory.load(LAB)
    assert {s.os for s in rack.switches} == {"sonic", "cumulus"}
    assert len(rack.hosts) == 8 and {h.role for h in rack.hosts} == {"worker", "ps", "traffic"}
    assert all(h.data_if == "ens1f0np0" for h in rack.hosts)  # group vars reach the hosts
    assert not rack.virtual


def test_every_field_of_the_lab_example_is_explained():
    text = LAB.read_text()
    fields = ("ansible_user", "ansible_host", "ansible_ssh_common_args", "trimlab_virtual", "data_mtu",
              "trim_switch_os", "trim_switch_platform", "ports", "facing", "data_if", "role", "data_ipv4",
              "data_ipv6", "nic_host_repair")
    for f in fields:
        assert any(f in line and "#" in line for line in text.splitlines()), f"{f} has no comment"


def test_profiles_render_for_every_switch_of_the_lab(tmp_path):
    rack = inventory.load(LAB)
    assert render_profiles(rack, "cumulus-default", tmp_path) == {"leaf-sonic": "sonic", "leaf-cumulus": "cumulus"}
    assert (tmp_path / "leaf-sonic.json").exists() and (tmp_path / "leaf-cumulus.yml").exists()
    cmds = (tmp_path / "leaf-cumulus.commands").read_text()
    assert "nv set interface swp1,swp2,swp3,swp4,swp64 packet-trim egress-eligibility traffic-class 2" in cmds
    with pytest.raises(SpecError, match="profile default: field size=128: platform cumulus-spectrum allows 256..1024 bytes, a multiple of 4"):
        render_profiles(rack, "default", tmp_path)


def _broken(tmp_path, edit):
    doc = yaml.safe_load(LAB.read_text())
    edit(doc["all"]["children"])
    p = tmp_path / "inv.yml"
    p.write_text(yaml.safe_dump(doc))
    return p


@pytest.mark.parametrize("edit,msg", [
    (lambda c: c["nic_hosts"]["hosts"]["gpu3"].update(role="gpu"), "host gpu3: role='gpu'; use one of worker, ps, traffic"),
    (lambda c: c["nic_hosts"]["hosts"]["gpu2"].pop("ansible_host"), "host gpu2: ansible_host is missing"),
    (lambda c: c["nic_hosts"]["hosts"]["gpu2"].update(data_ipv4=None, data_ipv6=None), "host gpu2: give data_ipv4"),
    (lambda c: c["nic_hosts"].pop("vars"), "host gpu1: data_if is missing"),
    (lambda c: c["trim_switches"]["hosts"]["leaf-sonic"].update(trim_switch_os="eos"), "switch leaf-sonic: trim_switch_os='eos'"),
    (lambda c: c["trim_switches"]["hosts"]["leaf-sonic"].pop("ports"), "switch leaf-sonic: ports is missing"),
    (lambda c: c["trim_switches"]["hosts"]["leaf-cumulus"]["ports"].update(swp9={"host": "gpu99"}),
     "switch leaf-cumulus: port swp9 is cabled to 'gpu99', which is not in nic_hosts"),
    (lambda c: c.pop("trim_switches"), "group trim_switches is missing"),
])
def test_inventory_errors_name_the_host_and_field(tmp_path, edit, msg):
    with pytest.raises(SpecError, match=msg):
        inventory.load(_broken(tmp_path, edit))


def test_provision_refuses_a_bad_profile_before_touching_anything(tmp_path):
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "provision", "-i", str(LAB), "--profile", "default"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "profile default: field size=128: platform cumulus-spectrum allows 256..1024 bytes, a multiple of 4" in out.stderr


@pytest.mark.parametrize("platform,msg", [
    ("tofino", "switch leaf-sonic: trim_switch_platform='tofino': unknown switch platform; use one of ideal, sonic"),
    ("cumulus-spectrum", "switch leaf-sonic: trim_switch_platform='cumulus-spectrum' does not run trim_switch_os=sonic; "
                         "cumulus-spectrum runs cumulus, vswitch"),
    ("sonic-th5", "profile cumulus-default: field size=256: platform sonic-th5 allows 206 bytes only"),
])
def test_the_inventory_names_each_switchs_platform_and_profiles_meet_its_limits(tmp_path, platform, msg):
    text = LAB.read_text().replace("trim_switch_platform: sonic ", f"trim_switch_platform: {platform} ")
    (tmp_path / "lab.yml").write_text(text)
    with pytest.raises(SpecError, match=re.escape(msg)):
        render_profiles(inventory.load(tmp_path / "lab.yml"), "cumulus-default", tmp_path)
