"""The agents as real processes on loopback addresses (127.0.0.x, no root): both topologies
train to identical parameters on every host, the packet log has one row per datagram,
and a flood of foreign and malformed packets only moves the discard counters."""

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from trimlab import rundir, wire
from trimlab.agents import workloads as W
from trimlab.agents.collective import shard_bounds
from trimlab.codec import get_codec
from trimlab.config import PACKET_LOG_FIELDS, WorkloadConfig

from tests.procnet import rx_queues, wait_until

ROOT = Path(__file__).resolve().parents[2]


def config(topology: str, workers: int = 3, steps: int = 6, base: int = 20) -> dict:
    return {
        "name": "t", "job": 7, "seed": 3, "steps": steps, "mtu": 1500, "topology": topology,
        "workload": {"kind": "synthetic", "model": "mlp", "batch": 32, "lr": 0.1, "momentum": 0.5},
        "codec": {"name": "embedded", "params": {"planes": 8}, "span": 4096, "coords": 480},
        "transport": {"dscp": 10, "control_dscp": 46, "deadline_ms": 300, "pacing_bps": None,
                      "port": 47100 + base, "ipv6": False},
        "truth_every": 2, "eval_every": 3,
        "ps": {"name": "ps1", "addr": f"127.0.{base}.100"} if topology == "ps" else None,
        "workers": [{"name": f"w{i + 1}", "addr": f"127.0.{base}.{i + 1}"} for i in range(workers)],
        "timeouts": {"startup_s": 60, "step_s": 30, "params_s": 30, "give_up_s": 10},
        "max_missed_steps": 3,
    }


def launch(cfg: dict, tmp: Path, late_rank: int | None = None) -> list[subprocess.Popen]:
    """Every agent of `cfg`; `late_rank` starts only once the others are up and waiting
    for it (the ps's socket is bound; a slow host)."""
    path = tmp / "agent.json"
    path.write_text(json.dumps(cfg))

    def worker(r):
        return subprocess.Popen([sys.executable, "-m", "trimlab.agents.worker", "--config", str(path), "--rank", str(r),
                                 "--out", str(tmp / f"w{r + 1}")], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    procs = [worker(r) for r in range(len(cfg["workers"])) if r != late_rank]
    if cfg["ps"]:
        procs.append(subprocess.Popen([sys.executable, "-m", "trimlab.agents.ps", "--config", str(path),
                                       "--out", str(tmp / "ps1")], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    if late_rank is not None:
        port = cfg["transport"]["port"]
        wait_until(lambda: rx_queues(port), f"a socket bound to port {port}")
        procs.append(worker(late_rank))
    return procs


def finish(procs) -> None:
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-2000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def finals(tmp: Path) -> dict:
    return {d.name: f for d in tmp.iterdir() if (f := rundir.Final.read(d))}


def test_ps_topology_identical_parameters_packet_log_and_flood(tmp_path):
    cfg = config("ps")
    procs = launch(cfg, tmp_path)
    ps_addr = (cfg["ps"]["addr"], cfg["transport"]["port"])
    stop = threading.Event()

    def flood():  # foreign source, then a known source with garbage and with another job
        foreign = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        foreign.bind(("127.0.20.99", 0))
        known = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        known.bind((cfg["workers"][0]["addr"], 0))
        other_job = wire.packetize(torch.ones(64), get_codec("embedded", planes=8), coords=64,
                                   ids=wire.PacketIds(job=8))[0]
        while not stop.is_set():
            foreign.sendto(b"x" * 100, ps_addr)
            known.sendto(b"\x00" * 10, ps_addr)
            known.sendto(other_job, ps_addr)
            time.sleep(0.002)

    t = threading.Thread(target=flood, daemon=True)
    t.start()
    try:
        finish(procs)
    finally:
        stop.set()
        t.join()
    f = finals(tmp_path)
    assert sorted(f) == ["ps1", "w1", "w2", "w3"]
    assert len({v.checksum for v in f.values()}) == 1  # bit-identical everywhere
    d = f["ps1"].discarded
    assert d["unknown_source"] > 0 and d["not_trimlab"] > 0 and d["other_job"] > 0, d
    assert f["ps1"].received == f["ps1"].expected and f["ps1"].missing == 0
    rows = (tmp_path / "ps1" / "packets.csv").read_text().splitlines()
    assert rows[0].split(",") == list(PACKET_LOG_FIELDS)
    accepted = [r.split(",") for r in rows[1:] if r.endswith(",accepted")]
    assert len(accepted) == f["ps1"].received
    assert {r[12] for r in accepted} == {"8"}  # untrimmed: every plane kept
    steps = (tmp_path / "ps1" / "steps.csv").read_text().splitlines()
    assert len(steps) == 1 + cfg["steps"]
    truth = sorted(p.name for p in (tmp_path / "w2" / "truth").iterdir())
    assert truth == ["step000000-rank1.npy", "step000002-rank1.npy", "step000004-rank1.npy"]


def test_sharded_topology_identical_parameters(tmp_path):
    cfg = config("sharded", base=21)
    finish(launch(cfg, tmp_path))
    f = finals(tmp_path)
    assert sorted(f) == ["w1", "w2", "w3"]
    assert len({v.checksum for v in f.values()}) == 1
    layout = rundir.GradientLayout.read(tmp_path / "w1")
    assert list(layout.buckets.values()) == list(shard_bounds(layout.numel, 3))
    for w in ("w1", "w2", "w3"):  # each owner logged the packets of its shard from the 2 others
        rows = (tmp_path / w / "packets.csv").read_text().splitlines()[1:]
        own = int(w[1:]) - 1
        assert {int(r.split(",")[4]) for r in rows} == set(range(3)) - {own}


def test_a_worker_that_starts_late_still_gets_every_step(tmp_path):
    cfg = config("ps", workers=2, steps=4, base=22)
    finish(launch(cfg, tmp_path, late_rank=1))
    f = finals(tmp_path)
    assert len({v.checksum for v in f.values()}) == 1
    assert f["ps1"].missing == 0  # the first step waited for everyone


def test_flat_sgd_and_parameter_round_trip():
    wl = W.build(WorkloadConfig(kind="digits", model="cnn"), seed=1)
    flat = W.flat_params(wl.model)
    W.set_flat_params(wl.model, flat * 2)
    assert torch.equal(W.flat_params(wl.model), flat * 2)
    x, y = wl.batch(1, 0, 2, 0, 16)
    assert x.shape == (16, 1, 8, 8) and torch.equal(x, wl.batch(1, 0, 2, 0, 16)[0])
    p = torch.ones(4)
    opt = W.FlatSGD(0.5, momentum=0.5)
    opt.step(p, torch.ones(4))
    opt.step(p, torch.ones(4))
    assert torch.allclose(p, torch.full((4,), 1 - 0.5 - 0.75))


def test_custom_workload_and_its_errors(tmp_path):
    data = {"x_train": torch.randn(40, 4), "y_train": torch.randint(0, 3, (40,)),
            "x_test": torch.randn(10, 4), "y_test": torch.randint(0, 3, (10,))}
    torch.save(data, tmp_path / "d.pt")
    wl = W.build(WorkloadConfig(kind="custom", factory="tests.unit.test_agents:tiny", dataset=str(tmp_path / "d.pt")), 0)
    assert wl.evaluate()[1] >= 0
    with pytest.raises(W.SpecError, match="workload.factory='nope:f': cannot import it"):
        W.build(WorkloadConfig(kind="custom", factory="nope:f", dataset=str(tmp_path / "d.pt")), 0)
    del data["y_test"]
    torch.save(data, tmp_path / "e.pt")
    with pytest.raises(W.SpecError, match="missing y_test"):
        W.build(WorkloadConfig(kind="custom", factory="tests.unit.test_agents:tiny", dataset=str(tmp_path / "e.pt")), 0)


def tiny():
    return torch.nn.Linear(4, 3)


def test_mnist1d_is_generated_cached_and_learnable(tmp_path, monkeypatch):
    monkeypatch.setenv("TRIMLAB_CACHE", str(tmp_path))
    import random
    before = np.random.get_state()[1][:4].copy(), random.random()
    random.seed(before[1])
    wl = W.build(WorkloadConfig(kind="mnist1d", model="cnn"), 3)
    assert tuple(wl.x_train.shape) == (8000, 1, 40) and tuple(wl.x_test.shape) == (2000, 1, 40)
    assert set(wl.y_train.tolist()) == set(range(10)) and (tmp_path / "mnist1d-10000.npz").exists()
    assert (np.random.get_state()[1][:4] == before[0]).all()  # the package's seeding is undone
    again = W.build(WorkloadConfig(kind="mnist1d", model="mlp"), 3)  # from the cache: the same data
    assert torch.equal(again.x_train, wl.x_train) and torch.equal(again.y_test, wl.y_test)
    opt = torch.optim.SGD(wl.model.parameters(), lr=0.1, momentum=0.9)
    for step in range(200):
        loss = wl.loss(*wl.batch(3, 0, 1, step, 64))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert wl.evaluate()[1] > 0.5  # ten classes: chance is 0.1


def test_digits_are_scikit_learns_and_load_from_the_cache_without_it(tmp_path, monkeypatch):
    from sklearn.datasets import load_digits
    monkeypatch.setenv("TRIMLAB_CACHE", str(tmp_path))
    data, target = W.digits()
    d = load_digits()
    assert np.array_equal(data, d.data) and data.dtype == d.data.dtype
    assert np.array_equal(target, d.target) and target.dtype == d.target.dtype
    assert (tmp_path / "digits.npz").exists()
    # a later process reads the cache and never imports scikit-learn (it costs as much as torch)
    out = subprocess.run([sys.executable, "-c", "import sys; from trimlab.agents.workloads import digits; "
                          "data, _ = digits(); print(data.shape, 'sklearn' in sys.modules)"],
                         env=os.environ | {"TRIMLAB_CACHE": str(tmp_path)}, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.split() == ["(1797,", "64)", "False"], out.stderr


@pytest.mark.parametrize("kind,shape,width,params", [
    ("mlp", (1, 8, 8), None, 64 * 128 + 128 + 128 * 10 + 10),
    ("mlp", (1, 8, 8), 32, 64 * 32 + 32 + 32 * 10 + 10),
    ("cnn", (1, 40), None, 7460),  # MNIST-1D's CNN
    ("cnn", (1, 40), 160, 263_690),  # ≥ 64 spans of 4096: the tolerance experiment's model
    ("cnn", (3, 32, 32), 8, 3 * 8 * 9 + 8 + 8 * 16 * 9 + 16 + 16 * 8 * 8 * 10 + 10)])
def test_the_models_width(kind, shape, width, params):
    model = W.make_model(kind, shape, 10, width)
    assert sum(p.numel() for p in model.parameters()) == params
    assert model(torch.zeros(2, *shape)).shape == (2, 10)


@pytest.mark.parametrize("kind,sub,train,test,label", [
    ("cifar10", "cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)], ["test_batch"], b"labels"),
    ("cifar100", "cifar-100-python", ["train"], ["test"], b"fine_labels")])
def test_cifar_from_a_local_directory_in_torchvision_layout(tmp_path, kind, sub, train, test, label):
    """A tiny stand-in written the way torchvision's archives are (pickled dicts of uint8
    rows, channel-major) loads with the right shapes, scale and labels."""
    import pickle
    rng = np.random.default_rng(0)
    (tmp_path / sub).mkdir()
    classes = 100 if kind == "cifar100" else 10
    for name in train + test:
        data = rng.integers(0, 256, (6, 3072), dtype=np.uint8)
        data[0, :1024] = 255  # the first image's red plane
        with open(tmp_path / sub / name, "wb") as f:
            pickle.dump({b"data": data, label: list(rng.integers(0, classes, 6))}, f)
    wl = W.build(WorkloadConfig(kind=kind, model="cnn", dataset=str(tmp_path)), 0)
    assert tuple(wl.x_train.shape) == (6 * len(train), 3, 32, 32) and tuple(wl.x_test.shape) == (6, 3, 32, 32)
    assert float(wl.x_train[0, 0].min()) == 1.0 and float(wl.x_train.max()) <= 1.0
    assert wl.model(wl.x_test).shape == (6, classes)
    with pytest.raises(W.SpecError, match=f"no {sub}/.* give the directory holding torchvision's {sub}/"):
        W.build(WorkloadConfig(kind=kind, dataset=str(tmp_path / "nothing")), 0)


@pytest.mark.parametrize("agent", ["worker", "ps", "traffic", "capture", "transport"])
def test_every_agent_has_help(agent):
    out = subprocess.run([sys.executable, "-m", f"trimlab.agents.{agent}", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "usage: python -m trimlab.agents." in out.stdout
