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


def _sonic_preflight(tmp: Path, version: str, capable: str) -> subprocess.CompletedProcess:
    """The SONiC task file's checks, run by Ansible on this machine against a version file
    and a stand-in for sonic-db-cli (a script that prints what STATE_DB would hold)."""
    (tmp / "sonic_version.yml").write_text(version)
    cli = tmp / "sonic-db-cli"
    cli.write_text(f"#!/bin/sh\necho '{capable}'\n")
    cli.chmod(0o755)
    play = tmp / "play.yml"
    play.write_text(f"""
- hosts: localhost
  connection: local
  gather_facts: false
  vars:
    ansible_python_interpreter: {sys.executable}
    trim_switch_sonic_release_floor: "202505"
    trim_switch_sonic_version_file: {tmp / 'sonic_version.yml'}
    trim_switch_sonic_db_cli: {cli}
  tasks:
    - ansible.builtin.include_tasks: {ROOT / 'playbooks/roles/trim_switch/tasks/sonic_preflight.yml'}
""")
    return subprocess.run([str(BIN / "ansible-playbook"), "-i", "localhost,", str(play)], capture_output=True,
                          text=True, env=_env(), timeout=300)


def test_sonic_release_floor_and_capability_are_checked(tmp_path):
    ok = _sonic_preflight(tmp_path, "build_version: 'SONiC.202505.12'\nrelease: '202505'\n", "true")
    assert ok.returncode == 0, ok.stdout[-2000:]
    old = _sonic_preflight(tmp_path, "build_version: 'SONiC.202411.3'\nrelease: '202411'\n", "true")
    assert old.returncode != 0 and "SONiC release 202411 (SONiC.202411.3) has no packet trimming; " \
        "it needs 202505 or later" in old.stdout
    incapable = _sonic_preflight(tmp_path, "build_version: 'SONiC.202511.1'\nrelease: '202511'\n", "")
    assert incapable.returncode != 0 and "the switch does not report packet trimming" in incapable.stdout \
        and "SWITCH_TRIMMING_CAPABLE is 'absent'" in incapable.stdout
