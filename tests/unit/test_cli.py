import subprocess
import sys


def test_cli_starts_without_importing_torch():
    code = "import sys, testbed.cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_help_lists_the_commands():
    out = subprocess.run([sys.executable, "-m", "testbed.cli", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for cmd in ("doctor", "plan", "bench", "demo"):
        assert cmd in out.stdout
