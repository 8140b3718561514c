"""The DDP comm hook with real processes: gloo rendezvous on loopback, gradients over the
trimmable UDP transport on 127.0.x addresses. Every rank ends with identical parameters,
close to DDP's own all-reduce (the codec's untrimmed error is ~1e-9), and the hook writes
the files the analysis reads."""

import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pandas as pd
import pytest
import torch

from trimlab import resources, rundir
from trimlab.agents.ddp_hook import HookError, TrimlabState
from trimlab.config import PHASES, AgentConfig

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = resources.example_ddp_script()
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])  # CUDA where a GPU exists


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(world: int, base: int) -> dict:
    return {"name": "ddp", "job": 9, "seed": 4, "steps": 12, "mtu": 1500, "topology": "sharded",
            "workload": {"kind": "ddp"},
            "codec": {"name": "embedded", "params": {"planes": 16}, "span": 4096, "coords": 480},
            "transport": {"dscp": 10, "control_dscp": 46, "deadline_ms": 500, "pacing_bps": None,
                          "port": 47300 + base, "ipv6": False},
            "truth_every": 5, "workers": [{"name": f"w{i + 1}", "addr": f"127.0.{base}.{i + 1}"} for i in range(world)]}


def launch(tmp: Path, comm: str, world: int = 3, steps: int = 12, base: int = 40, device: str = "cpu",
           extra=lambda rank: []) -> list[dict]:
    cfg_path = tmp / "agent.json"
    cfg_path.write_text(json.dumps(config(world, base)))
    port = free_port()
    procs = []
    for r in range(world):
        env = os.environ | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                            "WORLD_SIZE": str(world), "LOCAL_RANK": "0", "GLOO_SOCKET_IFNAME": "lo",
                            "TRIMLAB_CONFIG": str(cfg_path), "TRIMLAB_OUT": str(tmp / f"w{r + 1}")}
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), "--steps", str(steps), "--comm", comm,
                                       "--device", device, "--save", str(tmp / f"{comm}-{{rank}}.pt"), *extra(r)],
                                      cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-3000:]
        done.append(json.loads([ln for ln in out.splitlines() if '"done"' in ln][-1]))
    return done


def each_rank(world: int, body) -> None:
    """body(rank) for every rank at once, each in its own thread; any rank's error fails."""
    errors = []

    def run(r):
        try:
            body(r)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors


def flat(path: Path) -> torch.Tensor:
    return torch.cat([v.reshape(-1) for v in torch.load(path).values()])


@pytest.mark.parametrize("device", DEVICES)
def test_hook_trains_identically_on_every_rank_and_matches_allreduce(tmp_path, device):
    hook = launch(tmp_path, "trimlab", device=device)
    assert len({d["checksum"] for d in hook}) == 1  # identical parameters everywhere
    (tmp_path / "gloo").mkdir()
    base = launch(tmp_path / "gloo", "allreduce", device=device)
    a, b = flat(tmp_path / "trimlab-0.pt"), flat(tmp_path / "gloo" / "allreduce-0.pt")
    assert float((a - b).norm() / b.norm()) < 1e-4
    assert abs(hook[0]["test_acc"] - base[0]["test_acc"]) <= 0.02
    finals = [rundir.Final.read(tmp_path / f"w{r + 1}") for r in range(3)]
    assert len({f.checksum for f in finals}) == 1 and all(f.steps == 12 for f in finals)
    layout = rundir.GradientLayout.read(tmp_path / "w1")
    assert layout.topology == "ddp" and set(layout.owners.values()) == {1, 2}
    log = pd.read_csv(tmp_path / "w1" / "packets.csv")
    assert set(log["rank"]) == {1, 2} and (log["status"] == "accepted").all() and log["step"].nunique() == 12
    metrics = pd.read_csv(tmp_path / "w2" / "metrics.csv")
    assert len(metrics) == 12
    for phase in PHASES:  # every phase timed, every step
        assert (metrics[phase] >= 0).all() and metrics[phase].sum() > 0, phase
    assert sorted(p.name for p in (tmp_path / "w3" / "truth").iterdir())[0] == "step000000-rank2.npy"


def test_a_time_limit_stops_every_rank_at_the_same_evaluation(tmp_path):
    """Rank 1 alone is past its (tiny) limit at the first evaluation: every rank stops there,
    says so, and holds the same parameters."""
    def limit(rank):
        return ["--eval-every", "3", "--time-limit", "1e-9" if rank == 1 else "1e9"]
    done = launch(tmp_path, "allreduce", steps=12, extra=limit)
    assert [(d["steps"], d["time_limit"]) for d in done] == [(3, True)] * 3
    assert len({d["checksum"] for d in done}) == 1
    full = launch(tmp_path, "allreduce", steps=4, extra=lambda rank: ["--eval-every", "3", "--time-limit", "1e9"])
    assert [(d["steps"], d["time_limit"]) for d in full] == [(4, False)] * 3


def test_from_env_errors(monkeypatch):
    monkeypatch.delenv("TRIMLAB_CONFIG", raising=False)
    with pytest.raises(HookError, match="TRIMLAB_CONFIG is not set and torch.distributed is not initialized"):
        TrimlabState.from_env()
    from trimlab.agents.ddp_hook import _interface
    with pytest.raises(HookError, match="TRIMLAB_IFACE=nosuch0: no IPv4 address on that interface"):
        _interface("nosuch0")
    with pytest.raises(HookError, match="RANK=5: the trimlab configuration has ranks 0..2"):
        TrimlabState(AgentConfig.model_validate(config(3, 41)), 5)


def test_the_docstring_command_runs_under_plain_torchrun(tmp_path):
    """`torchrun --nproc-per-node N examples/ddp_train.py --steps 50` without TRIMLAB_CONFIG:
    the ranks build the configuration from the rendezvous (loopback), say so once, and
    train to identical parameters."""
    doc = next(line.strip() for line in SCRIPT.read_text().splitlines() if line.strip().startswith("torchrun"))
    argv = doc.split()
    assert argv[:3] == ["torchrun", "--nproc-per-node", "4"] and argv[3] == "examples/ddp_train.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIMLAB_")}
    cmd = [str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "2",
           "--master-port", str(free_port()), str(SCRIPT), *argv[4:]]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    done = [json.loads(ln) for ln in out.stdout.splitlines() if '"done"' in ln]
    assert len(done) == 2 and len({d["checksum"] for d in done}) == 1
    assert out.stderr.count("trimlab: TRIMLAB_CONFIG is not set: 2 ranks exchange gradients over lo "
                            "(127.0.0.2, 127.0.0.3)") == 1



@pytest.mark.parametrize("device", DEVICES)
def test_buckets_of_any_size_average_exactly_enough(tmp_path, device):
    """Three ranks (threads, each its own sockets) reduce buckets of 1, 2, 5 and 70 000
    coordinates: every rank gets the same mean, on the bucket's device, close to the exact
    one (untrimmed codec)."""
    cfg = config(3, 42)
    states = [TrimlabState(AgentConfig.model_validate(cfg), r, tmp_path / f"w{r + 1}") for r in range(3)]
    sizes = [1, 2, 5, 70_000]
    grads = {(r, i): torch.randn(n, generator=torch.Generator().manual_seed(10 * r + i)).to(device)
             for r in range(3) for i, n in enumerate(sizes)}
    out: dict = {}

    def rank(r):
        # queued at once, as DDP's hook does; the communication thread completes them in order
        futs = [states[r].submit(grads[(r, i)], i, i == len(sizes) - 1) for i in range(len(sizes))]
        for i, fut in enumerate(futs):
            out[(r, i)] = fut.wait()
    each_rank(3, rank)
    for i, n in enumerate(sizes):
        exact = sum(grads[(r, i)] for r in range(3)) / 3
        assert out[(0, i)].device.type == device
        assert torch.equal(out[(0, i)], out[(1, i)]) and torch.equal(out[(1, i)], out[(2, i)])
        assert float((out[(0, i)] - exact).norm() / exact.norm()) < 1e-3, n
    for s in states:
        s.close()
    layout = rundir.GradientLayout.read(tmp_path / "w1")
    # wire bucket = index × 3 + owner, for the shards rank 0 sends; shard_bounds leaves the
    # first ranks empty in a bucket smaller than the world: nothing is sent for those
    assert layout.owners == {2: 2, 4: 1, 5: 2, 7: 1, 8: 2, 10: 1, 11: 2}


def test_a_bucket_every_rank_lost_costs_the_deadline_not_the_step_timeout(tmp_path):
    """Two ranks (threads, each its own sockets), two buckets a step; every gradient packet
    of step 1's second bucket is lost both ways, as 50 % injected drops do to a 2-packet
    bucket. Neither rank can all-gather first and so show the other it is past that bucket:
    the SENT marks on the streams end it at the deadline, each owner's shard its own
    contribution, identical on both ranks; step 2 is whole again."""
    cfg = config(2, 43)
    cfg["timeouts"] = {"startup_s": 600, "step_s": 600}  # what the step would wait without the marks
    states = [TrimlabState(AgentConfig.model_validate(cfg), r, tmp_path / f"w{r + 1}") for r in range(2)]
    lost = (1, 1)  # (step, bucket)
    for s in states:  # the packets of `lost` never leave (unit test: no switch to drop them)
        for tx in s.ar.senders.values():
            def dropping(send, state=s):
                return lambda frames, *a, **k: None if (state.step, state.index) == lost else send(frames, *a, **k)
            tx.send_frames, tx.send_frames_later = dropping(tx.send_frames), dropping(tx.send_frames_later)
    sizes = [3000, 1000]
    grads = {(r, st, i): torch.randn(n, generator=torch.Generator().manual_seed(100 * r + 10 * st + i))
             for r in range(2) for st in range(3) for i, n in enumerate(sizes)}
    out: dict = {}

    def rank(r):
        for st in range(3):
            for i in range(len(sizes)):
                states[r].index = i
                out[(r, st, i)] = states[r].submit(grads[(r, st, i)], i, i == len(sizes) - 1).wait()
    each_rank(2, rank)
    for st in range(3):
        for i, n in enumerate(sizes):
            assert torch.equal(out[(0, st, i)], out[(1, st, i)])
            half = n // 2  # rank 0 owns [0, half), rank 1 the rest
            own = torch.cat([grads[(0, st, i)][:half], grads[(1, st, i)][half:]])
            exact = (grads[(0, st, i)] + grads[(1, st, i)]) / 2
            want = own if (st, i) == lost else exact
            assert float((out[(0, st, i)] - want).norm() / want.norm()) < 1e-3, (st, i)
    for s in states:
        s.close()
    log = pd.read_csv(tmp_path / "w1" / "packets.csv")
    assert sorted(set(zip(log["step"], log["bucket"]))) == [(0, 0), (0, 2), (1, 0), (2, 0), (2, 2)]


def test_a_failed_hook_reaches_the_runs_reason_in_its_own_words(monkeypatch):
    """DDP reports a hook's failed future as "Unable to cast <message> to Tensor"; the
    monitor gives the run's reason the hook's message alone."""
    import torch.distributed as dist

    from trimlab.testbed.orchestrator.monitor import _unwrapped

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))

        def failing(state, bucket):
            fut = torch.futures.Future()
            fut.set_exception(HookError("no gradient packets of step 3 from w2 within 30 s"))
            return fut
        model.register_comm_hook(None, failing)
        with pytest.raises(RuntimeError) as err:
            model(torch.ones(3, 4)).sum().backward()
    finally:
        dist.destroy_process_group()
    line = f"[rank0]: RuntimeError: {err.value}"
    assert _unwrapped(line) == "[rank0]: RuntimeError: no gradient packets of step 3 from w2 within 30 s"
