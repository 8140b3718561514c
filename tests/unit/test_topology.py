"""The run's network graph (which ports a packet may leave by), a fabric run's counters
merged over its switches, and the fabric figure."""

import json

import pytest

from trimlab import rundir
from trimlab.analysis import figures
from trimlab.analysis.rundata import RunData
from trimlab.analysis.topology import Topology

def manifest(**fields) -> rundir.Manifest:
    return rundir.Manifest(schema_version=1, name="t", status="succeeded", started="2026-12-05T00:00:00+00:00",
                           **fields)


# 2 leaves × 2 spines; w1, ps on leaf1; w2 on leaf2
MANIFEST = {
    "switches": ["leaf1", "leaf2", "spine1", "spine2"],
    "links": [["leaf1:Ethernet240", "spine1:Ethernet0"], ["leaf1:Ethernet244", "spine2:Ethernet0"],
              ["leaf2:Ethernet240", "spine1:Ethernet4"], ["leaf2:Ethernet244", "spine2:Ethernet4"]],
    "hosts": {"w1": {"role": "worker", "switch": "leaf1", "switch_port": "Ethernet0", "data_ipv4": "198.19.1.10"},
              "ps": {"role": "ps", "switch": "leaf1", "switch_port": "Ethernet4", "data_ipv4": "198.19.1.14"},
              "w2": {"role": "worker", "switch": "leaf2", "switch_port": "Ethernet0", "data_ipv4": "198.19.2.11"},
              "leaf1": {"role": "switch"}},
}


def test_paths_across_the_fabric_take_every_spine():
    t = Topology.from_manifest(manifest(**MANIFEST))
    assert t.host_port == {"w1": "leaf1:Ethernet0", "ps": "leaf1:Ethernet4", "w2": "leaf2:Ethernet0"}
    assert t.egress_ports("w2", "ps") == ["leaf2:Ethernet240", "leaf2:Ethernet244",
                                          "spine1:Ethernet0", "spine2:Ethernet0", "leaf1:Ethernet4"]
    assert t.egress_ports("ps", "w2") == ["leaf1:Ethernet240", "leaf1:Ethernet244",
                                          "spine1:Ethernet4", "spine2:Ethernet4", "leaf2:Ethernet0"]
    assert t.egress_ports("w1", "ps") == ["leaf1:Ethernet4"]  # same leaf: its port only


def test_one_switch_runs_keep_bare_port_names():
    m = {"switches": ["sw"], "hosts": {"w1": {"role": "worker", "switch": "sw", "switch_port": "Ethernet0"},
                                       "ps": {"role": "ps", "switch": "sw", "switch_port": "Ethernet8"}}}
    t = Topology.from_manifest(manifest(**m))
    assert t.host_port == {"w1": "Ethernet0", "ps": "Ethernet8"}
    assert t.egress_ports("w1", "ps") == ["Ethernet8"]
    old = {"hosts": {"w1": {"role": "worker", "switch_port": "Ethernet0"}}}  # runs before fabrics
    assert Topology.from_manifest(manifest(**old)).host_port == {"w1": "Ethernet0"}


def _counters(port_trims: dict[str, int]) -> dict:
    zero = {k: 0 for k in ("TX_PKTS", "TX_BYTES", "TRIM_PKTS", "TRIM_TX_PKTS", "TRIM_DRP_PKTS", "DROP_PKTS")}
    ports = {p: zero | {"TRIM_TX_PKTS": n} for p, n in port_trims.items()}
    return {"switch": zero | {"TRIM_TX_PKTS": sum(port_trims.values())}, "ports": ports,
            "queues": {p: [zero | {"TRIM_TX_PKTS": n}] + [zero] * 7 for p, n in port_trims.items()}}


@pytest.fixture
def fabric_run(tmp_path):
    (tmp_path / rundir.MANIFEST).write_text(manifest(**MANIFEST).model_dump_json())
    trims = {"leaf1": {"Ethernet0": 0, "Ethernet4": 5, "Ethernet240": 0, "Ethernet244": 0},
             "leaf2": {"Ethernet0": 0, "Ethernet240": 7, "Ethernet244": 0},
             "spine1": {"Ethernet0": 2, "Ethernet4": 0}, "spine2": {"Ethernet0": 0, "Ethernet4": 0}}
    for sw, ports in trims.items():
        d = rundir.switch_dir(tmp_path, sw)
        d.mkdir(parents=True)
        (d / rundir.COUNTERS_BEFORE).write_text(json.dumps(_counters({p: 0 for p in ports})))
        (d / rundir.COUNTERS_AFTER).write_text(json.dumps(_counters(ports)))
        (d / rundir.OCCUPANCY).write_text("time_s,port,queue,OCCUPANCY\n1.0,Ethernet0,1,100\n")
    return RunData.open(tmp_path)


def test_fabric_counters_and_occupancy_are_merged_with_switch_names(fabric_run):
    c = fabric_run.counters
    assert fabric_run.fabric
    assert c["switch"]["TRIM_TX_PKTS"] == 14
    assert c["ports"]["leaf2:Ethernet240"]["TRIM_TX_PKTS"] == 7
    assert c["queues"]["spine1:Ethernet0"][0]["TRIM_TX_PKTS"] == 2
    assert sorted(fabric_run.occupancy["port"]) == ["leaf1:Ethernet0", "leaf2:Ethernet0",
                                                    "spine1:Ethernet0", "spine2:Ethernet0"]
    assert fabric_run.hosts["w2"]["port"] == "leaf2:Ethernet0"


def test_fabric_figure_labels_each_port_that_trimmed(fabric_run):
    t = fabric_run.topology
    fig = figures.fabric(t.host_port, t.links, fabric_run.counters["ports"])
    notes = sorted(a.text for a in fig.layout.annotations)
    assert notes == ["2✂", "5✂", "7✂"]
    names = {n for tr in fig.data if tr.mode == "markers+text" for n in tr.text}
    assert names == {"leaf1", "leaf2", "spine1", "spine2", "w1", "w2", "ps"}
    one = figures.fabric({"w1": "Ethernet0"}, [], {})
    assert "one switch" in one.layout.annotations[0].text
