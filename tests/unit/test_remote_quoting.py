import subprocess

import pytest

from trimlab.testbed.remote import Host, quote

HOSTILE = ["plain", "with space", "it's", '"double"', "$(touch /tmp/trimlab-pwned)", "`id`",
           "a;b", "a|b", "a&&b", "*", "~", "$HOME", "-n", "new\nline", "", "é ünïcode", "back\\slash"]


@pytest.mark.parametrize("arg", HOSTILE)
def test_a_remote_shell_receives_every_argument_verbatim(arg, tmp_path):
    # What the remote sshd does with our command line: hand it to a POSIX shell.
    cmd = quote(["printf", "%s\\0", arg, "tail"])
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, cwd=tmp_path, check=True).stdout
    assert out.split(b"\0")[:-1] == [arg.encode(), b"tail"]
    assert list(tmp_path.iterdir()) == []  # nothing was expanded or executed


def test_host_from_inventory_takes_the_pinned_known_hosts():
    h = Host.from_inventory("w1", {"ansible_host": "198.18.0.10"}, {
        "ansible_user": "root", "ansible_ssh_private_key_file": "/r/keys/id",
        "ansible_ssh_common_args": "-o UserKnownHostsFile=/r/known_hosts -o StrictHostKeyChecking=yes"})
    assert (str(h.known_hosts), str(h.key_file), h.user, h.address) == ("/r/known_hosts", "/r/keys/id", "root", "198.18.0.10")
