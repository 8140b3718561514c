"""The playbooks pass ansible-playbook --syntax-check and ansible-lint's production profile."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def _env():
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "ANSIBLE_NOCOLOR": "1"}


def test_syntax_check():
    out = subprocess.run([str(BIN / "ansible-playbook"), "--syntax-check", "-i",
                          str(ROOT / "playbooks/inventories/lab.example.yml"), "site.yml"],
                         cwd=ROOT / "playbooks", capture_output=True, text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_ansible_lint_production_profile():
    out = subprocess.run([str(BIN / "ansible-lint"), "--profile", "production", "--nocolor", "playbooks/"],
                         cwd=ROOT, capture_output=True, text=True, env=_env(), timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Profile 'production' was required, and it passed" in out.stdout + out.stderr
