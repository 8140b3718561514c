"""`trimlab bench ddp`: median step time of the same DDP script and model on the same
virtual rack with trimlab's comm hook and with DDP's own gloo all-reduce, without and with
background congestion (a UDP flow into w1's port on the best-effort class). Both move their
gradients over the data network through the eBPF switch (gloo's TCP with DSCP 0, the hook's
UDP on the trimmable class). Rounds alternate the two, and the ratios are medians of
per-round ratios, so a slow spell of this shared machine hits both alike. Also reported:
how far the hook's final parameters are from all-reduce's when nothing is trimmed."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from trimlab import resources, rundir
from trimlab.config import (
    TRAFFIC_PORT,
    AgentConfig,
    CodecConfig,
    HostConfig,
    TransportConfig,
    WorkloadConfig,
)
from trimlab.spec import load_profile
from trimlab.targets import Port, get_target
from trimlab.vrack import rack

SCRIPT = resources.example_ddp_script()
MASTER_PORT = 29600


def _config(st, steps: int) -> AgentConfig:
    workers = [h for h in st.nic_hosts if h.role == "worker"]
    return AgentConfig(name="bench-ddp", job=11, seed=2, steps=steps, mtu=st.mtu, topology="sharded",
                       workload=WorkloadConfig(kind="ddp", steps=steps),
                       codec=CodecConfig(name="embedded", params={"planes": 16}, span=4096, coords=480),
                       transport=TransportConfig(dscp=10, control_dscp=46, deadline_ms=500),
                       workers=[HostConfig(name=h.name, addr=h.data_ipv4) for h in workers])


def _train(st, cfg_path: Path, comm: str, steps: int, out: Path) -> dict:
    """The script on every worker; rank 0's median step time (first 3 steps left out) and
    the final parameters."""
    workers = [h for h in st.nic_hosts if h.role == "worker"]
    procs = []
    for rank, h in enumerate(workers):
        env = os.environ | {"MASTER_ADDR": workers[0].data_ipv4, "MASTER_PORT": str(MASTER_PORT),
                            "RANK": str(rank), "WORLD_SIZE": str(len(workers)), "LOCAL_RANK": "0",
                            "GLOO_SOCKET_IFNAME": "eth1", "TRIMLAB_CONFIG": str(cfg_path),
                            "OMP_NUM_THREADS": "1"}  # 4 ranks share the cores: no oversubscription
        procs.append(subprocess.Popen(["ip", "netns", "exec", h.ns, sys.executable, str(SCRIPT), "--steps", str(steps),
                                       "--comm", comm, "--seed", "2", "--save", str(out / f"{comm}-{{rank}}.pt")],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        o, e = p.communicate(timeout=600)
        if p.returncode:
            raise RuntimeError(f"ddp_train.py --comm {comm} failed: {e.strip()[-800:]}")
        outs.append(o)
    times = [json.loads(ln)["step_s"] for ln in outs[0].splitlines() if '"event": "step"' in ln]
    return {"median_step_s": statistics.median(times[3:] or times),
            "params": torch.cat([v.reshape(-1) for v in torch.load(out / f"{comm}-0.pt").values()])}


def run(quick: bool = False, rack_id: str = "bdd") -> dict:
    steps, rounds = (12, 1) if quick else (40, 3)
    tmp = Path(tempfile.mkdtemp(prefix="trimlab-bench-ddp-"))
    st = rack.up(rack.plan(rack_id, 4, 0, 1, "100mbit", 1500, 0))
    flow = None
    try:
        prof = load_profile("default")
        st.vswitch().apply(get_target("vswitch").render(prof, [Port(p) for p in st.ports]).config)
        cfg_path = tmp / rundir.AGENT_CONFIG
        _config(st, steps).write(cfg_path)
        w1 = next(h for h in st.nic_hosts if h.role == "worker")
        tr = next(h for h in st.nic_hosts if h.role == "traffic")
        result: dict = {"bench": "ddp", "quick": quick, "steps": steps, "rounds": rounds, "workers": 4,
                        "rate": "100mbit", "background": "60mbit UDP, DSCP 0, into w1's port"}
        for congestion in (False, True):
            if congestion:
                flow = subprocess.Popen(["ip", "netns", "exec", tr.ns, sys.executable, "-m", "trimlab.agents.traffic", "send",
                                         "--dst", w1.data_ipv4, "--port", str(TRAFFIC_PORT), "--rate", "60mbit", "--dscp", "0"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            hook, gloo = [], []
            for _ in range(rounds):
                h = _train(st, cfg_path, "trimlab", steps, tmp)
                g = _train(st, cfg_path, "allreduce", steps, tmp)
                hook.append(h["median_step_s"])
                gloo.append(g["median_step_s"])
            key = "with_congestion" if congestion else "no_congestion"
            result[key] = {"hook_step_ms": round(1e3 * statistics.median(hook), 2),
                           "allreduce_step_ms": round(1e3 * statistics.median(gloo), 2),
                           "hook_over_allreduce": round(statistics.median(a / b for a, b in zip(hook, gloo)), 3)}
            if not congestion:
                a, b = h["params"], g["params"]
                result["no_congestion"]["params_rel_diff"] = float((a - b).norm() / b.norm())
            if flow is not None:
                flow.terminate()
                flow.wait(10)
                flow = None
        result["switch"] = st.vswitch().counters()["switch"]
        return result
    finally:
        if flow is not None:
            flow.kill()
            flow.wait()
        rack.down(st)
        shutil.rmtree(tmp, ignore_errors=True)
