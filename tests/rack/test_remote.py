"""trimlab.testbed.remote against the real sshd of every rack host."""

import subprocess
import time

import pytest

from tests.rack.conftest import host
from trimlab.testbed.remote import Fleet, Host, RemoteError, Session, fan_out


@pytest.fixture(scope="module")
def rrack(rack_factory):
    return rack_factory(workers=2, ps=1, traffic=0)


def rhost(st, name, **kw) -> Host:
    h = host(st, name)
    base = dict(name=h.name, address=h.mgmt_ip, known_hosts=st.dir / "known_hosts",
                key_file=st.dir / "keys" / "id_ed25519")
    return Host(**(base | kw))


def test_run_streams_lines_and_returns_the_exit_status(rrack, tmp_path):
    log = tmp_path / "w1.log"
    seen = []
    with Session(rhost(rrack, "w1")) as s:
        r = s.run(["sh", "-c", "for i in 1 2 3; do echo line $i; done; echo oops >&2; exit 3"],
                  log=log, on_line=seen.append)
        assert r.rc == 3 and r.stdout.splitlines() == ["line 1", "line 2", "line 3"] and r.stderr == "oops"
        with pytest.raises(RemoteError, match=r"host w1: `sh -c .*` exited 3: oops"):
            r.check()
        ip = s.run(["ip", "-br", "addr", "show", "eth1"]).check().stdout
        assert host(rrack, "w1").data_ipv4 in ip  # it ran inside w1's namespace
        env = s.run(["sh", "-c", 'echo "$TRIMLAB_X"'], env={"TRIMLAB_X": "a b;c"}).stdout
        assert env == "a b;c"
    assert log.read_text().splitlines() == ["line 1", "line 2", "line 3", "[stderr] oops"]
    assert seen == ["line 1", "line 2", "line 3", "oops"]


def test_a_command_runs_without_the_controllers_interactive_shell_set_up(rrack, tmp_path):
    """The virtual hosts share this machine's home: bash, started by sshd for each command,
    would source ~/.bashrc (pyenv or conda set-up, 0.1-0.5 s) before every command. The
    rack's sshd starts sessions at shell level 1, where bash does not."""
    with Session(rhost(rrack, "w1")) as s:
        # what sshd set (bash raises it to 2 for itself and lowers it again as it execs sh)
        assert s.run(["sh", "-c", 'echo "$SHLVL"']).check().stdout == "1"
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("echo bashrc-ran\n")
    env = {"HOME": str(home), "PATH": "/usr/bin:/bin", "SSH_CLIENT": "198.18.0.1 40000 22"}
    ran = subprocess.run(["bash", "-c", "true"], env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    skipped = subprocess.run(["bash", "-c", "true"], env=env | {"SHLVL": "1"}, capture_output=True, text=True,
                             stdin=subprocess.DEVNULL)
    assert ran.stdout == "bashrc-ran\n"  # this bash sources ~/.bashrc for a command sshd starts...
    assert skipped.stdout == ""  # ...but not at shell level 1


def test_hostile_arguments_arrive_verbatim(rrack, tmp_path):
    hostile = ["it's", "$(touch /tmp/trimlab-pwned-remote)", "a;b", "*", "new\nline", ""]
    with Session(rhost(rrack, "w2")) as s:
        out = s.run(["python3", "-c", "import sys, json; print(json.dumps(sys.argv[1:]))", *hostile]).check()
    import json
    assert json.loads(out.stdout) == hostile
    import os
    assert not os.path.exists("/tmp/trimlab-pwned-remote")


def test_changed_host_key_is_refused(rrack, tmp_path):
    lines = (rrack.dir / "known_hosts").read_text().splitlines()
    w1 = host(rrack, "w1")
    other_key = next(line for line in lines if not line.startswith(w1.mgmt_ip + " ")).split(" ", 1)[1]
    bad = tmp_path / "known_hosts"
    bad.write_text(f"{w1.mgmt_ip} {other_key}\n")
    with pytest.raises(RemoteError, match="does not match the one pinned .* refusing to connect"):
        Session(rhost(rrack, "w1", known_hosts=bad))
    bad.write_text("")
    with pytest.raises(RemoteError, match="no host key pinned .* never trusts an unknown key"):
        Session(rhost(rrack, "w1", known_hosts=bad))


def test_unreachable_host_fails_within_the_timeout(rrack):
    nobody = f"198.18.{rrack.slot}.250"  # on the rack's own management bridge, no host there
    with pytest.raises(RemoteError, match="unreachable within 2 s"):
        Session(rhost(rrack, "w1", address=nobody), connect_timeout=2)


def test_sftp_put_and_get_with_progress(rrack, tmp_path):
    src = tmp_path / "blob"
    src.write_bytes(bytes(range(256)) * 4096)
    calls = []
    with Session(rhost(rrack, "ps1")) as s:
        s.put(src, "/tmp/trimlab-test-blob", progress=lambda n, total: calls.append((n, total)))
        s.get("/tmp/trimlab-test-blob", tmp_path / "back" / "blob")
        s.run(["rm", "-f", "/tmp/trimlab-test-blob"]).check()
    assert (tmp_path / "back" / "blob").read_bytes() == src.read_bytes()
    assert calls[-1] == (src.stat().st_size, src.stat().st_size)


def test_fan_out_runs_on_every_host_in_parallel(rrack):
    """Parallel by the hosts' own clock (one kernel: the same clock in every namespace):
    every command started before any of them ended, however slow this machine is."""
    hosts = [rhost(rrack, n) for n in ("w1", "w2", "ps1")]
    out = fan_out(hosts, lambda s: s.run(["sh", "-c", "date +%s.%N; sleep 1; ip -br addr show eth1; date +%s.%N"])
                  .check().stdout)
    spans = {n: (float(o.split()[0]), float(o.split()[-1])) for n, o in out.items()}
    assert max(a for a, _ in spans.values()) < min(b for _, b in spans.values()), spans  # not 3 × 1 s in turn
    for name in ("w1", "w2", "ps1"):
        assert host(rrack, name).data_ipv4 in out[name]


def alive_in_group(s, pgid) -> int:
    """Members of a process group that are not zombies (exited, waiting for init)."""
    states = s.run(["sh", "-c", f"for p in $(pgrep -g {pgid}); do cut -d' ' -f3 /proc/$p/stat; done"]).stdout
    return sum(1 for st in states.split() if st != "Z")


def test_stop_signals_the_whole_remote_process_group(rrack, tmp_path):
    with Fleet.connect([rhost(rrack, "w1")]) as fleet:
        s = fleet.sessions["w1"]
        proc = s.start(["sh", "-c", "sleep 300 & sleep 300 & echo started; wait"], log=tmp_path / "bg.log")
        deadline = time.monotonic() + 5
        while "started" not in (tmp_path / "bg.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive_in_group(s, proc.pgid) >= 3  # the shell and both sleeps
        proc.stop()
        assert not proc.running()
        assert alive_in_group(s, proc.pgid) == 0  # nothing of the group is left
        # and a session closes whatever it still runs
        proc2 = s.start(["sleep", "300"])
    with Session(rhost(rrack, "w1")) as s2:
        assert alive_in_group(s2, proc2.pgid) == 0
