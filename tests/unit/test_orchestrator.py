"""The orchestrator's pure parts, without a rack: which host runs what (placement, with
its refusals before anything is touched) and the agents' command lines and environment."""

from pathlib import Path

import pytest

from trimlab.config import TRAFFIC_PORT
from trimlab.errors import SpecError
from trimlab.testbed import inventory
from trimlab.testbed.orchestrator import launch
from trimlab.testbed.orchestrator.placement import place
from trimlab.spec import ExperimentSpec, validated

pytestmark = pytest.mark.unit

LAB = Path(__file__).resolve().parents[2] / "playbooks" / "inventories" / "lab.example.yml"


def spec(**fields) -> ExperimentSpec:
    return validated(ExperimentSpec, {"name": "t", **fields})


@pytest.fixture(scope="module")
def rack():
    return inventory.load(LAB)


def test_roles_are_placed_from_the_inventory(rack):
    p = place(rack, spec(topology="ps"))
    assert p.ps.name == "gpu1" and [w.name for w in p.workers] == [f"gpu{i}" for i in range(2, 8)]
    assert [t.name for t in p.traffic] == ["gpu8"] and p.sink is p.ps  # flows go to the ps's port
    assert p.hosts["gpu3"].address == "192.0.2.103"
    ring = place(rack, spec(topology="sharded"))
    assert ring.ps is None and ring.sink is ring.workers[0]
    assert {p.label(sw) for sw in p.switches} == {sw.name for sw in rack.switches}


@pytest.mark.parametrize("edit,msg", [
    (lambda r: setattr(r, "hosts", [h for h in r.hosts if h.role != "ps"]), "topology=ps: inventory"),
    (lambda r: setattr(r, "hosts", [h for h in r.hosts if h.role != "worker"]), "no host with role worker"),
    (lambda r: setattr(r, "hosts", [h for h in r.hosts if h.role != "traffic"]), "congestion.background: the rack"),
])
def test_placement_refuses_a_rack_that_cannot_run_the_spec(edit, msg):
    r = inventory.load(LAB)
    edit(r)
    with pytest.raises(SpecError, match=msg):
        place(r, spec(topology="ps", congestion={"background": [{"rate": "10mbit"}]}))


def test_a_switch_capture_needs_the_virtual_switch(rack):
    with pytest.raises(SpecError, match="capture.points: 'switch' needs the virtual switch"):
        place(rack, spec(capture={"points": ["workers", "switch"]}))


def test_agents_start_with_the_inventorys_python_and_their_arguments(rack):
    p = place(rack, spec(topology="ps"))
    python = p.python("gpu2")
    assert launch.worker(p, "gpu2", 1, "/r/agent.json", "/r/w2") == [
        python, "-m", "trimlab.agents.worker", "--config", "/r/agent.json", "--rank", "1", "--out", "/r/w2"]
    assert launch.ps(p, "/r/agent.json", "/r/ps")[:3] == [p.python("gpu1"), "-m", "trimlab.agents.ps"]
    s = spec(topology="ps", congestion={"background": [{"rate": "10mbit", "protocol": "tcp"}]})
    flow = s.congestion.background[0]
    send = launch.traffic(p, "gpu8", 0, flow, s.flow_dscp(flow), "198.51.100.1", 9000)
    assert send[send.index("--port") + 1] == str(TRAFFIC_PORT) and send[send.index("--protocol") + 1] == "tcp"
    assert send[send.index("--dscp") + 1] == "0"
    assert send[send.index("--size") + 1] == "8972"  # datagrams fill the MTU
    sink = launch.sink(p, 0, flow, "198.51.100.1")
    assert sink[:3] == [p.python("gpu1"), "-m", "trimlab.agents.traffic"] and "sink" in sink


def test_the_capture_filter_takes_what_the_run_sends():
    port = spec().transport.port
    assert launch.capture_filter(spec(topology="ps")) == f"udp and (port {port} or port {port + 1})"
    # the sharded all-gather travels on TCP (trimlab.agents.stream)
    assert launch.capture_filter(spec(topology="sharded")).endswith(f"or (tcp and port {port + 2})")
    gloo = spec(topology="sharded", workload={"kind": "ddp", "comm": "gloo"})
    assert launch.capture_filter(gloo).startswith("tcp or (")  # gloo's all-reduce is TCP
    assert launch.capture_filter(spec(topology="ps"), flows_to_host=2).endswith(f"portrange {TRAFFIC_PORT}-{TRAFFIC_PORT + 1}")


@pytest.mark.parametrize("comm", ["gloo", "trimlab"])
def test_ddp_ranks_meet_where_their_traffic_goes(rack, comm):
    """gloo's own all-reduce meets and runs on the data network (through the switch); with
    the hook, gloo only meets, on the management network, and gradients take the hook."""
    s = spec(topology="sharded", workload={"kind": "ddp", "comm": comm})
    p = place(rack, s)
    argv, env = launch.ddp(p, s, 2, "/r/agent.json", "/r/out")
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == str(len(p.workers))
    first = p.workers[0]
    if comm == "gloo":
        assert env["MASTER_ADDR"] == first.vars["data_ipv4"] and env["GLOO_SOCKET_IFNAME"] == "ens1f0np0"
        assert argv[argv.index("--comm") + 1] == "allreduce"
    else:
        assert env["MASTER_ADDR"] == "192.0.2.102" and "GLOO_SOCKET_IFNAME" not in env  # a lab: its own routes
        assert argv[argv.index("--comm") + 1] == "trimlab"
    assert "OMP_NUM_THREADS" not in env  # a lab host's cores are its own
    assert "--width" not in argv and "--time-limit" not in argv  # the script's defaults


def test_the_ddp_script_gets_the_models_width_and_the_time_limit(rack):
    s = spec(topology="sharded", workload={"kind": "ddp", "data": "mnist1d", "model": "cnn", "width": 160,
                                           "time_limit_s": 90})
    argv, _ = launch.ddp(place(rack, s), s, 0, "/r/agent.json", "/r/out")
    assert argv[argv.index("--width") + 1] == "160" and argv[argv.index("--time-limit") + 1] == "90.0"


def test_injection_reaches_gloos_tcp_on_its_own_class():
    """With comm gloo the switch's injection reaches DSCP 0's queue (gloo's TCP), not the
    trimming queues, which carry nothing of gloo's; with the hook it stays on those."""
    from trimlab.testbed.orchestrator.placement import effective_profile
    gloo = spec(topology="sharded", workload={"kind": "ddp", "comm": "gloo"},
                congestion={"inject_probability": 0.1, "inject_action": "drop"})
    assert effective_profile(gloo).injection.queues == [0]
    hook = spec(topology="sharded", workload={"kind": "ddp"}, congestion={"inject_probability": 0.1})
    assert effective_profile(hook).injection.queues == []


def test_a_ddp_scripts_last_line_says_how_many_steps_it_ran():
    from trimlab.testbed.orchestrator import events
    done = events.parse('{"event": "done", "rank": 1, "test_acc": 0.9, "steps": 120, "time_limit": true, '
                        '"checksum": "ab"}')
    assert (done.rank, done.steps, done.time_limit, done.checksum) == (1, 120, True, "ab")
    old = events.parse('{"event": "done", "rank": 0, "checksum": "ab"}')  # an agent's: no step count
    assert old.steps is None and not old.time_limit
