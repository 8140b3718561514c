"""Switch targets: golden renderings of every shipped profile on every target, and each
target's limits as one clear error."""

import json
import os
from pathlib import Path

import pytest

from trimlab import resources
from trimlab.errors import SpecError
from trimlab.spec import BufferSpec, InjectionSpec, TrimProfile, load_profile
from trimlab.testbed.targets import TARGETS, Port, get_target

GOLDEN = Path(__file__).with_name("golden")
PROFILES = sorted(p.stem for p in resources.data("switch_configs", "profiles").glob("*.yml"))


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("profile", PROFILES)
def test_rendering_matches_golden_file(profile, target):
    t = get_target(target)
    try:
        got = t.render(load_profile(profile), list(t.default_ports)).text()
    except SpecError as exc:
        got = f"error: {exc}\n"
    path = GOLDEN / f"{profile}.{target}.txt"
    if os.environ.get("TRIMLAB_UPDATE_GOLDEN"):
        path.write_text(got)
    assert got == path.read_text(), f"regenerate with TRIMLAB_UPDATE_GOLDEN=1 if intended: {path}"


def test_shipped_profiles_exist():
    assert {"default", "sonic-default", "cumulus-default", "asymmetric"} <= set(PROFILES)


def profile(**kw):
    base = {"name": "p", "size": 256, "dscp": 10, "queue": 4, "eligible_queues": [1]}
    return TrimProfile.model_validate(base | kw)


@pytest.mark.parametrize("target,kw,msg", [
    ("cumulus", {"size": 128}, "profile p: field size=128: platform cumulus-spectrum allows 256..1024 bytes, a multiple of 4"),
    ("cumulus", {"size": 1026}, "size=1026: platform cumulus-spectrum allows 256..1024 bytes, a multiple of 4"),
    ("cumulus", {"size": 258}, "size=258: platform cumulus-spectrum allows 256..1024 bytes, a multiple of 4"),
    ("cumulus", {"queue": 9}, "queue=9: platform cumulus-spectrum allows trimmed packets on queues 0..7"),
    ("cumulus", {"queue": "dynamic"}, "queue='dynamic': target cumulus allows a switch priority 0..7"),
    ("cumulus", {"exempt_sources": ["10.0.0.0/8"]}, "exempt_sources=.*target cumulus allows none"),
    ("cumulus", {"injection": {"probability": 0.1}}, "injection.probability=0.1: target cumulus allows 0 only"),
    ("sonic", {"queue": 300}, None),  # caught by the profile model itself
    ("sonic", {"size": 10000}, "size=10000: platform sonic allows 1..9216 bytes"),
    ("sonic", {"queue": 16}, "queue=16: platform sonic allows trimmed packets on queues 0..15"),
    ("sonic", {"injection": {"probability": 0.5}}, "injection.probability=0.5: target sonic allows 0 only"),
    ("vswitch", {"size": 40}, "size=40: target vswitch allows 62..9014 bytes"),
    ("vswitch", {"queue": "dynamic"}, "queue='dynamic': target vswitch allows a queue 0..7"),
])
def test_target_limits_name_field_target_and_range(target, kw, msg):
    """The platform's limits (the OS's default platform here), then the OS's own."""
    if msg is None:
        with pytest.raises(SpecError, match="queue=300: a queue index is 0..255"):
            profile(**kw)
        return
    t = get_target(target)
    with pytest.raises(SpecError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        t.render(profile(**kw), list(t.default_ports))


@pytest.mark.parametrize("kw,msg", [
    ({"dscp": 64}, "dscp=64: a DSCP is 0..63"),
    ({"dscp": "from-tc"}, "dscp=from-tc needs trim_tc"),
    ({"trim_tc": 3}, "trim_tc and port_dscp only apply with dscp: from-tc"),
    ({"eligible_queues": [8]}, "eligible_queues: 8 is not a queue"),
    ({"exempt_sources": ["nope"]}, "exempt_sources: 'nope' is not an IP prefix"),
    ({"dscp_to_tc": {70: 1}}, "dscp_to_tc: 70: 1 must map"),
    # SONiC's BUFFER_QUEUE would hold Ethernet0|1 twice, and the trimmed packets' (dropping) profile win
    ({"queue": 1, "eligible_queues": [1, 2]}, r"queue=1 is also in eligible_queues \[1, 2\]: trimmed packets need"),
])
def test_profile_model_errors(kw, msg):
    with pytest.raises(SpecError, match=msg):
        profile(**kw)


def test_ports_are_checked_per_target():
    with pytest.raises(SpecError, match="port 'Ethernet0': target cumulus names ports like swp1"):
        get_target("cumulus").render(profile(), [Port("Ethernet0")])
    with pytest.raises(SpecError, match="port_dscp: no DSCP for network-facing ports"):
        get_target("sonic").render(profile(dscp="from-tc", trim_tc=4, port_dscp={"host": 3}),
                                   [Port("Ethernet0"), Port("Ethernet4", "network")])


def test_exempt_sources_render_a_disable_trim_acl():
    r = get_target("sonic").render(profile(exempt_sources=["198.19.0.13/32", "fd00:7472::d/128"]),
                                   [Port("Ethernet0")])
    rules = r.config["ACL_RULE"]
    assert rules["TRIMLAB_NO_TRIM|EXEMPT_0"] == {"PRIORITY": "9999", "SRC_IP": "198.19.0.13/32",
                                                 "PACKET_ACTION": "DISABLE_TRIM"}
    assert rules["TRIMLAB_NO_TRIM|EXEMPT_1"]["SRC_IPV6"] == "fd00:7472::d/128"
    # ACL_TABLE's fields as sonic-acl.yang names them (lower case); its ACL_RULE's are upper case
    assert r.config["ACL_TABLE"] == {"TRIMLAB_NO_TRIM": {"policy_desc": "trimlab: sources never trimmed",
                                                         "type": "TRIMLAB_TRIMMING_L3", "stage": "INGRESS",
                                                         "ports": ["Ethernet0"]}}


def test_voq_switches_key_buffer_queues_by_hostname_and_asic():
    t = get_target("sonic")
    t.configure("leaf1", {"switch_type": "voq", "asic_name": "asic0", "sonic_hostname": "lc1"})
    r = t.render(profile(), [Port("Ethernet0"), Port("Ethernet4")])
    assert sorted(r.config["BUFFER_QUEUE"]) == ["lc1|asic0|Ethernet0|1", "lc1|asic0|Ethernet0|4",
                                                "lc1|asic0|Ethernet4|1", "lc1|asic0|Ethernet4|4"]
    t = get_target("sonic")
    t.configure("leaf2", {"switch_type": "voq", "asic_name": "asic1"})  # the inventory name by default
    assert "leaf2|asic1|Ethernet0|1" in t.render(profile(), [Port("Ethernet0")]).config["BUFFER_QUEUE"]
    with pytest.raises(SpecError, match="switch leaf3: switch_type voq keys BUFFER_QUEUE as hostname|asic|port|queue; "
                                        "set asic_name"):
        get_target("sonic").configure("leaf3", {"switch_type": "voq"})
    with pytest.raises(SpecError, match="switch leaf4: switch_type='fabric'"):
        get_target("sonic").configure("leaf4", {"switch_type": "fabric"})
    plain = get_target("sonic")
    plain.configure("leaf5", {"data_mtu": 9000})
    assert "Ethernet0|1" in plain.render(profile(), [Port("Ethernet0")]).config["BUFFER_QUEUE"]


def test_vswitch_rendering_is_what_the_virtual_switch_reads():
    from trimlab.testbed.vrack.vswitch import default_config, parse_config_db
    ports = ["Ethernet0", "Ethernet4"]
    r = get_target("vswitch").render(load_profile("sonic-default"), [Port(p) for p in ports])
    cfg = parse_config_db(r.config, ports, default_config(ports, 1000), mtu=1500)
    assert (cfg.size, cfg.dscp_value, cfg.queue_index) == (128, 48, 6)
    assert cfg.actions["Ethernet0"][3] == "trim" and cfg.budgets["Ethernet0"][6] == 65536
    # a run's buffer reaches every queue of the rack's ports, not only the trimming ones
    deep = load_profile("default").model_copy(update={"buffer": BufferSpec(queue_bytes=4_000_000,
                                                                           trim_queue_bytes=8192)})
    cfg = parse_config_db(get_target("vswitch").render(deep, [Port(p) for p in ports]).config, ports,
                          default_config(ports, 1000), mtu=1500)
    for port in ports:
        assert cfg.budgets[port] == [4_000_000] * 7 + [8192]
        assert cfg.actions[port] == ["drop", "trim"] + ["drop"] * 6


def test_injection_can_be_told_which_queues_it_reaches():
    """By default injection reaches the trimming queues; `injection.queues` names others
    (gloo's TCP on DSCP 0, a queue that drops): rendered, read back, and checked."""
    from trimlab.testbed.vrack.vswitch import default_config, parse_config_db
    ports = ["Ethernet0"]
    prof = load_profile("default").model_copy(update={"injection": InjectionSpec(probability=0.1, action="drop",
                                                                                  queues=[0])})
    r = get_target("vswitch").render(prof, [Port("Ethernet0")])
    assert r.config["TRIMLAB_INJECT"]["GLOBAL"]["queues"] == "0"
    cfg = parse_config_db(r.config, ports, default_config(ports, 1000), mtu=1500)
    assert cfg.inject_queues == [0] and cfg.to_config_db()["TRIMLAB_INJECT"] == r.config["TRIMLAB_INJECT"]
    plain = get_target("vswitch").render(load_profile("default"), [Port("Ethernet0")])
    assert plain.config["TRIMLAB_INJECT"]["GLOBAL"]["queues"] == "1"  # the profile's eligible queue
    # applied over the gloo point's switch (a sweep's next point), it reaches the trimming queue again
    assert parse_config_db(plain.config, ports, cfg, mtu=1500).inject_queues == [1]
    # a dropping profile's eligible queue too: its queue's action is drop, like every other
    dropping = get_target("vswitch").render(load_profile("drop"), [Port("Ethernet0")])
    assert parse_config_db(dropping.config, ports, cfg, mtu=1500).inject_queues == [1]
    # "" in a hand-written fragment: the queues whose action is trim
    assert parse_config_db({"TRIMLAB_INJECT": {"GLOBAL": {"queues": ""}}}, ports, cfg, mtu=1500).inject_queues == []
    with pytest.raises(SpecError, match=r"TRIMLAB_INJECT\|GLOBAL.queues: 9 is out of range \(0..7\)"):
        parse_config_db({"TRIMLAB_INJECT": {"GLOBAL": {"queues": "0,9"}}}, ports, default_config(ports, 1000), 1500)
    with pytest.raises(ValueError, match="queues"):
        InjectionSpec(queues=[8])


def test_asymmetric_profile_gives_each_port_the_dscp_of_its_facing():
    from trimlab.testbed.vrack.vswitch import config_diff, default_config, parse_config_db
    ports = [Port("Ethernet0"), Port("Ethernet240", "network")]
    names = [p.name for p in ports]
    r = get_target("vswitch").render(load_profile("asymmetric"), ports)
    cfg = parse_config_db(r.config, names, default_config(names, 1000), mtu=1500)
    assert cfg.tc_value == 4 and cfg.trim_dscp == {"Ethernet0": 20, "Ethernet240": 10}
    assert cfg.to_config_db()["SWITCH_TRIMMING"]["GLOBAL"] == r.config["SWITCH_TRIMMING"]["GLOBAL"]
    again = parse_config_db(cfg.to_config_db(), names, cfg, mtu=1500)  # what it reads back means the same
    assert config_diff(cfg, again) == {}
    back = parse_config_db({"SWITCH_TRIMMING": {"GLOBAL": {"dscp_value": "46"}}}, names, cfg, mtu=1500)
    assert back.tc_value is None and back.port_trim_dscp("Ethernet240") == 46
    bad = json.loads(json.dumps(r.config))
    del bad["PORT_QOS_MAP"]["Ethernet240"]
    with pytest.raises(SpecError, match="PORT_QOS_MAP|Ethernet240.tc_to_dscp_map: from-tc needs"):
        parse_config_db(bad, names, default_config(names, 1000), mtu=1500)
