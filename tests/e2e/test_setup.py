import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _freeze():
    return subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True,
                          text=True, check=True).stdout


def test_second_make_setup_installs_nothing_new():
    before = _freeze()
    out = subprocess.run(["make", "-C", str(ROOT), "setup"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    assert "system packages present" in out.stdout and "venv ready" in out.stdout
    assert "apt-get install" not in out.stdout and "pip install" not in out.stdout
    assert _freeze() == before
