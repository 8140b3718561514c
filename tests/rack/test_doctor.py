import json
import subprocess
import sys


def test_doctor_passes_on_this_machine(root_only):
    out = subprocess.run([sys.executable, "-m", "trimlab.testbed.cli", "doctor", "--json"],
                         capture_output=True, text=True, timeout=120)
    checks = json.loads(out.stdout)
    failed = [c for c in checks if c["required"] and not c["ok"]]
    assert out.returncode == 0 and not failed, failed
    names = {c["name"] for c in checks}
    assert {"network namespaces", "tc clsact", "tc htb", "tc BPF program", "tool: sshd", "tool: tcpdump"} <= names
    from trimlab import native

    path = next(c for c in checks if c["name"] == "codec path")
    best = native.runnable()[0]
    assert path["ok"] and path["detail"].startswith(f"native kernels, {best.name}: {best.title}")
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "tldoc" not in left  # its scratch namespace is gone
