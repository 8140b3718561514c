"""Experiment specs: every shipped spec validates; every malformed one is one clear error
naming the key path and what is allowed, with no side effect."""

from pathlib import Path

import pytest
import yaml

from trimlab.errors import SpecError
from trimlab.spec import ExperimentSpec, load_experiment, validated

ROOT = Path(__file__).resolve().parents[2]


def spec(**kw):
    return validated(ExperimentSpec, {"name": "t", **kw})


@pytest.mark.parametrize("path", sorted((ROOT / "experiments").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_specs_validate(path):
    s = load_experiment(str(path))
    assert s.points()


def test_defaults_and_sweep_points():
    s = load_experiment(str(ROOT / "experiments/incast.yaml"))
    names = [p.codec.name for p in s.points()]
    assert names == ["embedded", "sign_tail", "fp32"]
    assert len({p.name for p in s.points()}) == 3
    assert s.points()[0].congestion.background[0].rate == "30mbit"


def test_seeds_repeat_every_point():
    s = spec(sweep={"codec.name": ["embedded", "fp32"]}, seeds=[3, 7],
             extra_points=[{"congestion.inject_probability": 0.1}])
    pts = s.points()
    assert [(p.name, p.seed) for p in pts] == [
        ("t-000-name_embedded-s3", 3), ("t-000-name_embedded-s7", 7), ("t-001-name_fp32-s3", 3),
        ("t-001-name_fp32-s7", 7), ("t-002-inject_probability_0.1-s3", 3), ("t-002-inject_probability_0.1-s7", 7)]
    from trimlab.rundir import point_of
    assert point_of(pts[1].name) == "t-000-name_embedded" and point_of("t-000-x") == "t-000-x"
    assert [p.seed for p in spec(seeds=[5, 6]).points()] == [5, 6]
    with pytest.raises(SpecError, match="seeds: the spec sweeps seed too"):
        spec(seeds=[1], sweep={"seed": [1, 2]})
    with pytest.raises(SpecError, match=r"seeds: \[1, 1\] repeats a seed"):
        spec(seeds=[1, 1])


def test_set_overrides_apply_before_validation(tmp_path):
    s = load_experiment(str(ROOT / "experiments/default.yaml"),
                        ["workload.steps=7", "codec.params={planes: 8}", "congestion.inject_probability=0.25"])
    assert (s.workload.steps, s.codec.params, s.congestion.inject_probability) == (7, {"planes": 8}, 0.25)
    with pytest.raises(SpecError, match="workload.steps: Input should be greater than or equal to 1"):
        load_experiment(str(ROOT / "experiments/default.yaml"), ["workload.steps=0"])
    with pytest.raises(SpecError, match=r"--set 'steps': use key.path=value"):
        load_experiment(str(ROOT / "experiments/default.yaml"), ["steps"])


MALFORMED = [
    ({"name": "bad name!"}, "name: String should match pattern"),
    ({"colour": "red"}, "colour: Extra inputs are not permitted"),
    ({"seed": -1}, "seed: Input should be greater than or equal to 0"),
    ({"seed": 2 ** 32}, "seed: Input should be less than 4294967296"),
    ({"job": 70000}, "job: Input should be less than 65536"),
    ({"rack": {"virtual": {"workers": 0}}}, "rack.virtual.workers: Input should be greater than or equal to 1"),
    ({"rack": {"virtual": {"workers": 33}}}, "rack.virtual.workers: Input should be less than or equal to 32"),
    ({"rack": {"virtual": {"rate": "fast"}}}, "rack.virtual.rate: String should match pattern"),
    ({"rack": {"virtual": {"mtu": 100}}}, "rack.virtual.mtu: Input should be greater than or equal to 1280"),
    ({"rack": {"virtual": {"traffic_hosts": 5}}}, "rack.virtual.traffic_hosts: Input should be less than or equal to 2"),
    ({"rack": {"cloud": True}}, "rack.cloud: Extra inputs are not permitted"),
    ({"profile": "nope"}, "profile 'nope' not found; profiles: asymmetric, cumulus-default, default, drop, sonic-default"),
    ({"workload": {"kind": "imagenet"}}, "workload.kind: must be one of 'digits', 'synthetic', 'mnist1d', 'cifar10', "
                                         "'cifar100', 'custom' or 'ddp'"),
    ({"workload": {"kind": "cifar10"}}, "workload.kind=cifar10 needs workload.dataset: the local directory"),
    ({"workload": {"dataset": "/d"}}, "workload.dataset only applies to workload.kind=custom, cifar10 or cifar100"),
    ({"workload": {"kind": "ddp"}}, "workload.kind=ddp: set topology: sharded"),
    ({"workload": {"script": "x.py"}}, "workload.script only applies to workload.kind=ddp"),
    ({"workload": {"model": "transformer"}}, "workload.model: must be one of 'mlp' or 'cnn'"),
    ({"workload": {"steps": 0}}, "workload.steps: Input should be greater than or equal to 1"),
    ({"workload": {"time_limit_s": 60}}, "workload.time_limit_s only applies to workload.kind=ddp"),
    ({"workload": {"kind": "ddp", "time_limit_s": 0}, "topology": "sharded"},
     "workload.time_limit_s: Input should be greater than 0"),
    ({"workload": {"kind": "custom", "factory": "m:f", "dataset": "/d", "width": 8}},
     "workload.width does not apply to workload.kind=custom"),
    ({"workload": {"width": 0}}, "workload.width: Input should be greater than or equal to 1"),
    ({"workload": {"batch": "lots"}}, "workload.batch: Input should be a valid integer"),
    ({"workload": {"lr": 0}}, "workload.lr: Input should be greater than 0"),
    ({"workload": {"kind": "custom"}}, "workload.kind=custom needs workload.factory"),
    ({"workload": {"factory": "m:f"}}, "workload.factory only applies to workload.kind=custom"),
    ({"workload": {"kind": "custom", "factory": "nocolon", "dataset": "/d"}}, "workload.factory='nocolon': use 'package.module:function'"),
    ({"codec": {"name": "zip"}}, "codec.name: must be one of 'embedded', 'sign_tail', 'fp32' or 'bf16'"),
    ({"codec": {"params": {"planes": 40}}}, "codec.params: embedded: planes=40: must be 1..16"),
    ({"codec": {"params": {"bits": 3}}}, "codec.params: codec 'embedded': .* its parameters are: planes, unbiased"),
    ({"codec": {"span": 1000}}, "codec.span=1000: must be a power of two"),
    ({"codec": {"span": 16}}, "codec.span: Input should be greater than or equal to 32"),
    ({"codec": {"coords": 100}}, "codec.coords=100: must be a positive multiple of 32"),
    ({"transport": {"dscp": 64}}, "transport.dscp: Input should be less than or equal to 63"),
    ({"transport": {"dscp": 46}}, "transport.control_dscp=46: must differ from transport.dscp"),
    ({"transport": {"deadline_ms": 0}}, "transport.deadline_ms: Input should be greater than 0"),
    ({"transport": {"port": 80}}, "transport.port: Input should be greater than or equal to 1024"),
    ({"transport": {"pacing": "soon"}}, "transport.pacing: String should match pattern"),
    ({"congestion": {"inject_probability": 1.5}}, "congestion.inject_probability: Input should be less than or equal to 1"),
    ({"congestion": {"inject_action": "mirror"}}, "congestion.inject_action: must be one of 'trim' or 'drop'"),
    ({"congestion": {"background": [{"dscp": 3}]}}, "congestion.background.0.rate: Field required"),
    ({"congestion": {"background": [{"rate": "1gbit", "protocol": "sctp"}]}}, "congestion.background.0.protocol: must be one of 'udp' or 'tcp'"),
    ({"capture": {"points": ["router"]}}, "capture.points.0: must be one of 'workers', 'ps' or 'switch'"),
    ({"capture": {"sender_snaplen": 10}}, "capture.sender_snaplen: Input should be greater than or equal to 64"),
    ({"truth": {"every": 0}}, "truth.every: Input should be greater than or equal to 1"),
    ({"transport": {"dscp": 24}}, r"transport.dscp=24: maps to queue 3, which profile default does not trim \(eligible_queues \[1\]\)"),
    ({"transport": {"control_dscp": 12}}, "transport.control_dscp=12: maps to trimmable queue 1 of profile default"),
    ({"profile": "sonic-default"}, "transport.dscp=10: maps to queue 1, which profile sonic-default does not trim"),
    ({"topology": "sharded", "workload": {"kind": "ddp", "comm": "gloo"}, "congestion": {"inject_probability": 0.1}},
     "congestion.inject_action=trim: gloo's TCP segments cannot be trimmed usefully"),
    ({"topology": "ring"}, "topology: must be one of 'ps' or 'sharded'"),
    ({"topology": "sharded", "rack": {"virtual": {"workers": 1}}}, "topology=sharded: needs rack.virtual.workers >= 2"),
    ({"workload": {"momentum": 1.0}}, "workload.momentum: Input should be less than 1"),
    ({"sweep": {"workload.steps": [1, 2]}}, "sweep.workload.steps: cannot be swept; sweepable keys: seed, topology, profile"),
    ({"sweep": {"codec.name": []}}, "sweep.codec.name: give at least one value"),
    ({"sweep": {"codec.name": ["embedded", "zip"]}}, r"sweep point 1 \(name_zip\): codec.name: must be one of"),
]


@pytest.mark.parametrize("data,msg", MALFORMED, ids=[m[1][:40] for m in MALFORMED])
def test_malformed_specs_name_the_key_and_what_is_allowed(data, msg, tmp_path):
    assert len(MALFORMED) >= 30
    with pytest.raises(SpecError, match=msg) as err:
        s = spec(**data)
        s.points()
    assert "\n" not in str(err.value)  # one line
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "t", **data}))
    with pytest.raises(SpecError):
        load_experiment(str(path)).points()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing else was written


def test_unreadable_specs(tmp_path):
    with pytest.raises(SpecError, match="missing.yaml: no such file"):
        load_experiment(str(tmp_path / "missing.yaml"))
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SpecError, match="a spec is a YAML mapping"):
        load_experiment(str(tmp_path / "list.yaml"))
    (tmp_path / "broken.yaml").write_text("name: [\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_experiment(str(tmp_path / "broken.yaml"))


def test_paper_sweep_pairs_trim_and_drop_and_adds_a_congestion_point():
    pts = load_experiment(str(ROOT / "experiments/paper_sweep.yaml")).points()
    assert len(pts) == 3 * 4 * 2 + 1 and len({p.name for p in pts}) == len(pts)
    injected = pts[:-1]
    assert {(p.codec.name, p.congestion.inject_probability, p.congestion.inject_action) for p in injected} == {
        (c, q, a) for c in ("embedded", "sign_tail", "fp32") for q in (0.0, 0.01, 0.1, 0.5) for a in ("trim", "drop")}
    last = pts[-1]
    assert last.congestion.inject_probability == 0 and last.congestion.background
    assert last.rack.virtual.buffer_bytes == 8192 and injected[0].rack.virtual.buffer_bytes == 4_000_000


def test_extra_points_errors_name_the_point():
    with pytest.raises(SpecError, match=r"extra_points\[0\] \(nope_1\): codec.nope"):
        spec(extra_points=[{"codec.nope": 1}]).points()
    with pytest.raises(SpecError, match=r"extra_points\[1\] \(name_zip\): codec.name: must be one of"):
        spec(extra_points=[{"seed": 2}, {"codec.name": "zip"}]).points()
    assert [p.seed for p in spec(extra_points=[{"seed": 2}]).points()] == [0, 2]  # the spec itself, then the extra


def test_contenders_run_at_every_point():
    s = spec(contenders=[{}, {"codec.name": "fp32"}], sweep={"congestion.inject_probability": [0, 0.1]},
             extra_points=[{"rack.virtual.rate": "10mbit"}], seeds=[1, 2])
    pts = s.points()
    assert [(p.name, p.codec.name, p.congestion.inject_probability, p.rack.virtual.rate) for p in pts[::2]] == [
        ("t-000-c0-inject_probability_0-s1", "embedded", 0.0, "1gbit"),
        ("t-001-c1-inject_probability_0-s1", "fp32", 0.0, "1gbit"),
        ("t-002-c0-inject_probability_0.1-s1", "embedded", 0.1, "1gbit"),
        ("t-003-c1-inject_probability_0.1-s1", "fp32", 0.1, "1gbit"),
        ("t-004-c0-rate_10mbit-s1", "embedded", 0.0, "10mbit"),
        ("t-005-c1-rate_10mbit-s1", "fp32", 0.0, "10mbit")]
    assert [p.seed for p in pts[:2]] == [1, 2]
    # a point's own value wins over the contender's
    assert spec(contenders=[{"codec.name": "fp32"}], extra_points=[{"codec.name": "bf16"}]).points()[-1].codec.name == "bf16"
    with pytest.raises(SpecError, match=r"sweep point 0, contenders\[1\] \(c1-base\): codec.nope"):
        spec(contenders=[{}, {"codec.nope": 1}]).points()


def test_a_background_flow_can_take_the_gradients_class():
    flows = {"background": [{"rate": "10mbit", "dscp": "gradients"}]}
    hook = spec(congestion=flows, transport={"dscp": 12})
    gloo = spec(congestion=flows, topology="sharded", workload={"kind": "ddp", "comm": "gloo"})
    assert hook.flow_dscp(hook.congestion.background[0]) == 12
    assert gloo.flow_dscp(gloo.congestion.background[0]) == 0  # gloo's TCP travels on DSCP 0
    with pytest.raises(SpecError, match=r"congestion.background.0.dscp=64: a DSCP is 0..63, or 'gradients'"):
        spec(congestion={"background": [{"rate": "10mbit", "dscp": 64}]})


def test_the_tolerance_experiment_is_the_issues_grid_on_a_converging_model():
    from trimlab.agents.workloads import make_model
    from trimlab.analysis.report import codec_label, contender
    from trimlab.spec import load_profile
    s = load_experiment(str(ROOT / "experiments/tolerance.yaml"))
    pts = s.points()
    ps = [0, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5]
    names = {contender(p.workload.comm, codec_label(p.codec), p.congestion, load_profile(p.profile).discard_action)
             for p in pts}
    assert names == {"trimlab trim embedded", "trimlab trim sign_tail", "trimlab trim sign_tail_unrotated",
                     "trimlab trim fp32", "trimlab drop embedded", "gloo (TCP, drop)"}
    assert len(pts) == len(names) * (len(ps) + 2) * 3 and len(s.seeds) >= 3
    assert sorted({p.congestion.inject_probability for p in pts}) == ps
    loaded = [p for p in pts if p.congestion.background]
    assert len({p.congestion.background[0].rate for p in loaded}) == 2  # natural congestion at two levels
    assert {p.rack.virtual.buffer_bytes for p in loaded} == {65536}  # queues the load fills
    assert all(p.rack.virtual.buffer_bytes >= 1 << 21 for p in pts if not p.congestion.background)  # only injection cuts
    assert all(p.flow_dscp(p.congestion.background[0]) == (0 if p.workload.comm == "gloo" else p.transport.dscp)
               for p in loaded)  # each load on the contender's own class
    model = make_model(s.workload.model, (1, 40), 10, s.workload.width)
    assert sum(x.numel() for x in model.parameters()) >= 64 * s.codec.span  # ≥ 64 RHT spans
    assert s.workload.time_limit_s and s.target_accuracy
