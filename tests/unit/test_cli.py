import os
import subprocess
import sys


def test_cli_starts_without_importing_torch():
    code = "import sys, trimlab.testbed.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("doctor", "plan", "bench", "demo"):
        assert cmd in out.stdout


import pytest  # noqa: E402


@pytest.mark.parametrize("spec,msg", [
    ("name: x\ncodec: {name: fp32, coords: 480}\n", "codec.coords=480: does not fit mtu=1500 with codec fp32; at most 352"),
    ("name: x\nworkload: {steps: 0}\n", "workload.steps: Input should be greater than or equal to 1"),
    ("name: x\ncongestion: {background: [{rate: 1mbit}]}\nrack: {virtual: {traffic_hosts: 0}}\n",
     "congestion.background: needs rack.virtual.traffic_hosts >= 1"),
    ("name: x\nprofile: sonic-default\ncongestion: {inject_probability: 0.1}\n",
     "transport.dscp=10: maps to queue 1"),
])
def test_run_refuses_bad_specs_before_touching_anything(tmp_path, spec, msg):
    path = tmp_path / "s.yaml"
    path.write_text(spec)
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "run", str(path), "--runs", str(tmp_path / "runs")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert msg in out.stderr and len(out.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("device,msg", [
    ("tpu", "--device tpu: use cpu or cuda"),
    ("cuda", "--device cuda: torch sees no CUDA device here; run it on a machine with a GPU"),
])
def test_bench_codec_refuses_a_device_it_cannot_use(device, msg):
    # CUDA hidden, so the refusal is the same on a machine with a GPU
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "bench", "codec", "--device", device],
                         capture_output=True, text=True, timeout=120, env=os.environ | {"CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 2 and out.stderr.strip() == f"error: {msg}", out.stderr
