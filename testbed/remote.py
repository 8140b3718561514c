"""SSH sessions to rack hosts (paramiko): pinned host keys, keepalives, bounded timeouts,
shlex-quoted commands, output streamed line by line into per-host logs, SFTP, fan-out,
and stopping every remote process a session started (by its process group).

    with Session(host) as s:
        r = s.run(["python", "-m", "trimlab.agents.worker", "--step", "3"], log=run_dir / "w1.log")
        proc = s.start(["tcpdump", "-i", "eth1", "-w", "/tmp/w1.pcap"], log=...)
        proc.stop()
"""

from __future__ import annotations

import contextlib
import re
import shlex
import socket
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from trimlab.errors import TrimlabError


class RemoteError(TrimlabError):
    """A host cannot be reached, authenticated or trusted, or a command failed."""

    exit_code = 1


@dataclass(frozen=True)
class Host:
    name: str
    address: str
    known_hosts: Path
    key_file: Path
    user: str = "root"
    port: int = 22

    @classmethod
    def from_inventory(cls, name: str, hvars: dict, inventory_vars: dict) -> "Host":
        """A host of an Ansible inventory (the rack's or a lab's)."""
        v = {**inventory_vars, **hvars}
        m = re.search(r"UserKnownHostsFile=(\S+)", v.get("ansible_ssh_common_args", ""))
        known = Path(m.group(1)) if m else Path.home() / ".ssh" / "known_hosts"
        key = Path(v.get("ansible_ssh_private_key_file", Path.home() / ".ssh" / "id_ed25519"))
        return cls(name, v["ansible_host"], known, key, v.get("ansible_user", "root"),
                   int(v.get("ansible_port", 22)))


@dataclass
class Result:
    host: str
    argv: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float

    def check(self) -> "Result":
        if self.rc != 0:
            tail = (self.stderr or self.stdout).strip().splitlines()[-1:] or [""]
            raise RemoteError(f"host {self.host}: `{shlex.join(self.argv)}` exited {self.rc}: {tail[0]}")
        return self


def quote(argv: Iterable[str]) -> str:
    """The command line a remote shell runs: every argument quoted, nothing expanded."""
    return shlex.join(str(a) for a in argv)


def _env_prefix(env: dict[str, str] | None) -> list[str]:
    return ["env", *(f"{k}={v}" for k, v in (env or {}).items())] if env else []


class _LineSink:
    """Splits a byte stream into lines, appends them to a log (prefixed), keeps the text."""

    def __init__(self, log, prefix: str, on_line: Callable[[str], None] | None):
        self.log, self.prefix, self.on_line = log, prefix, on_line
        self.buf = b""
        self.lines: list[str] = []

    def feed(self, data: bytes, final: bool = False) -> None:
        self.buf += data
        *whole, self.buf = self.buf.split(b"\n")
        if final and self.buf:
            whole.append(self.buf)
            self.buf = b""
        for raw in whole:
            line = raw.decode(errors="replace")
            self.lines.append(line)
            if self.log is not None:
                self.log.write(f"{self.prefix}{line}\n")
                self.log.flush()
            if self.on_line is not None:
                self.on_line(line)


class RemoteProcess:
    """A process started with Session.start: its own session and process group remotely."""

    def __init__(self, session: "Session", argv: list[str], channel, pgid: int, thread):
        self.session, self.argv, self.channel, self.pgid, self._thread = session, argv, channel, pgid, thread
        self.rc: int | None = None

    def wait(self, timeout: float | None = None) -> int | None:
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.rc = self.channel.recv_exit_status()
        return self.rc

    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, sig: str = "TERM", grace: float = 5.0) -> int | None:
        """Signal the whole remote process group; SIGKILL if it outlives `grace`."""
        if self.running():
            self.session.run(["kill", f"-{sig}", "--", f"-{self.pgid}"], timeout=10)
            if self.wait(grace) is None:
                self.session.run(["kill", "-KILL", "--", f"-{self.pgid}"], timeout=10)
                self.wait(grace)
        return self.rc


class Session:
    """One SSH connection, trusting only the host key pinned in `host.known_hosts`."""

    def __init__(self, host: Host, connect_timeout: float = 10.0, keepalive_s: int = 5):
        import paramiko  # heavy (cryptography): only when a host is reached

        self.host = host
        self.procs: list[RemoteProcess] = []
        self.client = paramiko.SSHClient()
        try:
            self.client.load_host_keys(str(host.known_hosts))
        except FileNotFoundError:
            raise RemoteError(f"host {host.name}: known_hosts file {host.known_hosts} is missing") from None
        self.client.set_missing_host_key_policy(paramiko.RejectPolicy())
        where = f"host {host.name} ({host.user}@{host.address}:{host.port})"
        try:
            self.client.connect(host.address, port=host.port, username=host.user,
                                key_filename=str(host.key_file), timeout=connect_timeout,
                                auth_timeout=connect_timeout, banner_timeout=connect_timeout,
                                allow_agent=False, look_for_keys=False)
        except paramiko.BadHostKeyException:
            raise RemoteError(f"{where}: its host key does not match the one pinned in "
                              f"{host.known_hosts}; refusing to connect. If the host was "
                              "rebuilt, replace its line there") from None
        except paramiko.AuthenticationException:
            raise RemoteError(f"{where}: authentication with {host.key_file} failed") from None
        except paramiko.SSHException as exc:
            if "not found in known_hosts" in str(exc):
                raise RemoteError(f"{where}: no host key pinned in {host.known_hosts}; add it "
                                  "(trimlab never trusts an unknown key)") from None
            if "banner" in str(exc):
                raise RemoteError(f"{where}: no SSH server answered within {connect_timeout:g} s") from None
            raise RemoteError(f"{where}: SSH failed: {exc}") from None
        except (OSError, socket.timeout) as exc:
            raise RemoteError(f"{where}: unreachable within {connect_timeout:g} s ({exc})") from None
        self.client.get_transport().set_keepalive(keepalive_s)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        """Stop every process this session started, then disconnect."""
        for p in self.procs:
            try:
                p.stop()
            except (RemoteError, OSError, EOFError):
                pass
        self.client.close()

    @property
    def connected(self) -> bool:
        t = self.client.get_transport()
        return t is not None and t.is_active()

    @contextlib.contextmanager
    def _alive(self):
        """paramiko's errors of a dead connection, as the RemoteError every caller handles."""
        import paramiko  # loaded already: the session holds a client

        if not self.connected:
            raise RemoteError(f"host {self.host.name}: lost its SSH connection")
        try:
            yield
        except paramiko.SSHException as exc:
            raise RemoteError(f"host {self.host.name}: lost its SSH connection ({exc})") from None

    def _channel(self, command: str):
        with self._alive():
            chan = self.client.get_transport().open_session()
            chan.exec_command(command)
        return chan

    @contextlib.contextmanager
    def _sftp(self):
        with self._alive(), self.client.open_sftp() as sftp:
            yield sftp

    @staticmethod
    def _pump(chan, out: _LineSink, err: _LineSink, deadline: float | None) -> bool:
        """Copy a channel's output into the sinks until it closes; False on timeout."""
        chan.settimeout(0.2)
        while True:
            got = False
            while chan.recv_ready():
                out.feed(chan.recv(65536))
                got = True
            while chan.recv_stderr_ready():
                err.feed(chan.recv_stderr(65536))
                got = True
            # done: the command exited and said all, or the connection died (closed, no status)
            if ((chan.exit_status_ready() and chan.eof_received) or chan.closed) and not chan.recv_ready() \
                    and not chan.recv_stderr_ready():
                out.feed(b"", final=True)
                err.feed(b"", final=True)
                return True
            if deadline is not None and time.monotonic() > deadline:
                return False
            if not got:
                time.sleep(0.01)

    def run(self, argv: list[str], timeout: float | None = 600, env: dict[str, str] | None = None,
            log: Path | None = None, on_line: Callable[[str], None] | None = None) -> Result:
        """Run a command to completion; stdout/stderr stream into `log` line by line."""
        argv = [str(a) for a in argv]
        t0 = time.monotonic()
        with open(log, "a") if log else _Null() as f:
            out = _LineSink(f if log else None, "", on_line)
            err = _LineSink(f if log else None, "[stderr] ", on_line)
            chan = self._channel(quote(_env_prefix(env) + argv))
            done = self._pump(chan, out, err, None if timeout is None else t0 + timeout)
            if not done:
                chan.close()
                raise RemoteError(f"host {self.host.name}: `{quote(argv)}` did not finish within {timeout:g} s")
            rc = chan.recv_exit_status()
        return Result(self.host.name, argv, rc, "\n".join(out.lines), "\n".join(err.lines),
                      time.monotonic() - t0)

    def start(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None,
              on_line: Callable[[str], None] | None = None) -> RemoteProcess:
        """Start a long-running command in its own remote process group; its output streams
        into `log`. `stop()` (or closing the session) signals the whole group."""
        argv = [str(a) for a in argv]
        # setsid: the command leads a new process group, whose id the shell prints first.
        # --wait: setsid forks when sshd's shell already leads a group; waiting keeps the
        # channel open until the command ends, and passes its exit status back.
        launcher = ["setsid", "--wait", "sh", "-c", 'echo "trimlab-pgid $$"; exec "$@"', "sh",
                    *_env_prefix(env), *argv]
        chan = self._channel(quote(launcher))
        f = open(log, "a") if log else None
        out = _LineSink(f, "", on_line)
        err = _LineSink(f, "[stderr] ", on_line)
        first = b""
        deadline = time.monotonic() + 10
        while b"\n" not in first:
            if chan.recv_ready():
                first += chan.recv(1)
            elif chan.exit_status_ready() or time.monotonic() > deadline:
                raise RemoteError(f"host {self.host.name}: `{quote(argv)}` did not start")
            else:
                time.sleep(0.005)
        pgid = int(first.split()[-1])

        def pump():
            try:
                self._pump(chan, out, err, None)
            finally:
                if f:
                    f.close()

        thread = threading.Thread(target=pump, daemon=True, name=f"ssh-{self.host.name}")
        thread.start()
        proc = RemoteProcess(self, argv, chan, pgid, thread)
        self.procs.append(proc)
        return proc

    def put(self, local: Path, remote: str, progress: Callable[[int, int], None] | None = None) -> None:
        with self._sftp() as sftp:
            sftp.put(str(local), remote, callback=progress)

    def get(self, remote: str, local: Path, progress: Callable[[int, int], None] | None = None) -> None:
        local.parent.mkdir(parents=True, exist_ok=True)
        with self._sftp() as sftp:
            sftp.get(remote, str(local), callback=progress)


    def get_tree(self, remote: str, local: Path) -> list[Path]:
        """Copy a remote directory tree (regular files only); returns the local files."""
        got = []
        with self._sftp() as sftp:
            todo = [(remote, local)]
            while todo:
                rdir, ldir = todo.pop()
                try:
                    entries = sftp.listdir_attr(rdir)
                except FileNotFoundError:
                    continue
                ldir.mkdir(parents=True, exist_ok=True)
                for e in entries:
                    rpath, lpath = f"{rdir}/{e.filename}", ldir / e.filename
                    if stat.S_ISDIR(e.st_mode):
                        todo.append((rpath, lpath))
                    elif stat.S_ISREG(e.st_mode):
                        sftp.get(rpath, str(lpath))
                        got.append(lpath)
        return got


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def fan_out(hosts: list[Host], fn: Callable[[Session], object], max_workers: int = 16,
            connect_timeout: float = 10.0) -> dict[str, object]:
    """Run fn(session) on every host in parallel; a host's RemoteError is its result."""
    def one(h: Host):
        try:
            with Session(h, connect_timeout=connect_timeout) as s:
                return fn(s)
        except RemoteError as exc:
            return exc

    with ThreadPoolExecutor(max_workers=max(1, min(max_workers, len(hosts)))) as pool:
        return dict(zip([h.name for h in hosts], pool.map(one, hosts)))


@dataclass
class Fleet:
    """Open sessions to many hosts, closed (and their processes stopped) together."""

    sessions: dict[str, Session] = field(default_factory=dict)

    @classmethod
    def connect(cls, hosts: list[Host], connect_timeout: float = 10.0) -> "Fleet":
        results = {}
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(hosts)))) as pool:
            futures = {h.name: pool.submit(Session, h, connect_timeout) for h in hosts}
            errors = []
            for name, fut in futures.items():
                try:
                    results[name] = fut.result()
                except RemoteError as exc:
                    errors.append(str(exc))
        fleet = cls(results)
        if errors:
            fleet.close()
            raise RemoteError("; ".join(errors))
        return fleet

    def each(self, fn: Callable[[str, Session], object], hosts: list[str] | None = None) -> dict[str, object]:
        """fn(name, session) on every host (or those of `hosts`, in that order) at once (each
        host's SSH round trips overlap the others'); the results by host, or the first
        host's exception raised."""
        names = list(self.sessions) if hosts is None else hosts
        with ThreadPoolExecutor(max_workers=max(1, min(16, len(names)))) as pool:
            futures = {n: pool.submit(fn, n, self.sessions[n]) for n in names}
            return {n: f.result() for n, f in futures.items()}

    def close(self) -> None:
        for s in self.sessions.values():
            s.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
