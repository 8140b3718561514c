"""UDP transport for gradient packets, IPv4 or IPv6: DSCP (and ECN) marking on send, the
TOS/traffic class each packet arrived with on receive (IP_RECVTOS / IPV6_RECVTCLASS),
large socket buffers, batched non-blocking receive, optional pacing to a rate. The command
line numbers its datagrams, to check marking and loss by hand.

    python -m trimlab.agents.transport send --dst 198.19.0.12 --dscp 10 --count 100 --size 1000
    python -m trimlab.agents.transport recv --port 47000 --idle 1
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import json
import os
import queue
import select
import fcntl
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
from dataclasses import dataclass

import numpy as np

from trimlab import wire
from trimlab.config import GRADIENT_PORT

BUFFER_BYTES = 32 << 20
UDP_SEGMENT = 103  # linux/udp.h: a send's segment size (UDP GSO), as SOL_UDP ancillary data
GSO_MAX_SEGMENTS = 64  # linux/udp.h: UDP_MAX_SEGMENTS
GSO_MAX_BYTES = 65000  # the whole send stays one IP datagram
_SEQ = struct.Struct("!I")  # the command line's datagram numbers


def family(addr: str) -> int:
    return socket.AF_INET6 if ":" in addr else socket.AF_INET


def tos_byte(dscp: int, ecn: int = 0) -> int:
    if not (0 <= dscp <= 63 and 0 <= ecn <= 3):
        raise ValueError(f"dscp={dscp} (0..63), ecn={ecn} (0..3)")
    return (dscp << 2) | ecn


def set_tos(sock: socket.socket, dscp: int, ecn: int = 0) -> None:
    """Mark everything `sock` sends with this DSCP (and ECN codepoint)."""
    tos = tos_byte(dscp, ecn)
    if sock.family == socket.AF_INET6:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, tos)
    else:
        sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, tos)


def set_max_pacing_rate(sock: socket.socket, rate_bps: float) -> None:
    """Cap the socket's rate in the kernel (fq paces to it; other qdiscs ignore it)."""
    so_max_pacing_rate = getattr(socket, "SO_MAX_PACING_RATE", 47)
    try:
        sock.setsockopt(socket.SOL_SOCKET, so_max_pacing_rate, min(int(rate_bps / 8), 2**32 - 1))
    except OSError:
        pass


def _tc(*args: str) -> subprocess.CompletedProcess:
    """`tc ARGS`; a host without tc (or a hung one) reads as a failed command."""
    try:
        return subprocess.run(["tc", *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(["tc", *args], 127, "", str(exc))


def route_device(dst: str) -> str | None:
    try:
        route = subprocess.run(["ip", "route", "get", dst], capture_output=True, text=True, timeout=10).stdout
        return route.split(" dev ", 1)[1].split()[0]
    except (OSError, IndexError, subprocess.TimeoutExpired):
        return None


class HtbFlow:
    """A socket's flow shaped by the kernel at its rate: an htb class of its own under the
    host NIC's line-rate class 1:1 (the virtual rack's hosts), chosen by SO_PRIORITY. The
    kernel's timer, not the sender's wake-ups, then spaces the packets, so the rate holds
    while the sender is starved of CPU (its backlog waits in the class). Needs
    CAP_NET_ADMIN; the class goes when the flow closes."""

    def __init__(self, dev: str, minor: int):
        self.dev, self.classid = dev, f"1:{minor:x}"

    @classmethod
    def attach(cls, sock: socket.socket, dev: str, rate_bps: float, minor: int,
               frame_over_payload: float = 1.0, burst_bytes: int | None = None) -> "HtbFlow | None":
        """Shape `sock` (leaving by device `dev`) at `rate_bps` of payload, or None where the
        device has no such htb (or no right to it). htb counts whole frames:
        `frame_over_payload` scales the class's rate. At most `burst_bytes` (default: 1 ms
        of the rate, 15 kB at least) leave back to back after the class was idle."""
        if "class htb 1:1 " not in _tc("class", "show", "dev", dev).stdout:
            return None
        flow, rate = cls(dev, minor), f"{int(rate_bps * frame_over_payload)}bit"
        burst = str(burst_bytes or max(15000, int(rate_bps / 8 * 1e-3)))
        made = _tc("class", "replace", "dev", dev, "parent", "1:1", "classid", flow.classid, "htb", "rate", rate,
                   "ceil", rate, "burst", burst, "cburst", burst)
        if made.returncode or _tc("qdisc", "replace", "dev", dev, "parent", flow.classid, "handle", f"{minor:x}:",
                                  "pfifo", "limit", "20000").returncode:
            flow.close()
            return None
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_PRIORITY, (1 << 16) | minor)
        except OSError:
            flow.close()
            return None
        return flow

    def drain(self, sock: socket.socket, backlog_bytes: int, rate_bps: float) -> None:
        """Until what `sock` queued has left (a class goes with its packets), at most the
        time `backlog_bytes` need at `rate_bps` and a second more."""
        until = time.monotonic() + backlog_bytes * 8 / rate_bps + 1
        while unsent_bytes(sock) and time.monotonic() < until:
            time.sleep(0.005)

    def close(self) -> None:
        _tc("class", "del", "dev", self.dev, "classid", self.classid)


def kernel_pacing(sock: socket.socket, dst: str, rate_bps: float, minor: int, frame_over_payload: float = 1.0,
                  htb: bool = False, burst_bytes: int | None = None) -> tuple[str | None, HtbFlow | None]:
    """Have the kernel pace `sock` to `rate_bps` (of payload) on its way to `dst`, where it
    can: an fq qdisc on the route's device paces to SO_MAX_PACING_RATE (lab hosts' common
    default); with `htb`, a class of its own on the virtual rack's host NIC. Returns how
    ("fq", "htb 1:MINOR" or None: user space alone) and the class to close."""
    set_max_pacing_rate(sock, rate_bps * frame_over_payload)
    dev = route_device(dst)
    if dev and any(line.startswith("qdisc fq ") for line in _tc("qdisc", "show", "dev", dev).stdout.splitlines()):
        return "fq", None
    flow = HtbFlow.attach(sock, dev, rate_bps, minor, frame_over_payload, burst_bytes) if htb and dev else None
    return (f"htb {flow.classid}", flow) if flow else (None, None)


def unsent_bytes(sock: socket.socket) -> int:
    """Bytes a socket handed the kernel that have not left the host yet (SIOCOUTQ)."""
    return struct.unpack("i", fcntl.ioctl(sock, termios.TIOCOUTQ, b"\0" * 4))[0]


def _set_buffers(s: socket.socket, opt: int, size: int) -> int:
    """Ask for `size` bytes; the kernel caps it at net.core.[rw]mem_max. Returns what it gave."""
    s.setsockopt(socket.SOL_SOCKET, opt, size)
    return s.getsockopt(socket.SOL_SOCKET, opt)


class Pacer:
    """Paces a byte stream to `rate_bps` and keeps its deficit: when the process oversleeps
    (on a busy host it often does), the bytes that fell due meanwhile go at once, so the
    rate over any longer span is the one asked for. The make-up is bounded: at most
    `burst_bytes` go back to back beyond the packet due (a gradient sender keeps that under
    a switch buffer; a background flow may allow more to hold its rate); a sender further
    behind forgets the rest (`forgotten_s`), and its delivered rate, which is measured,
    falls short. `clock` and `sleep` are injectable for tests."""

    def __init__(self, rate_bps: float, burst_bytes: int = 2 * 1500, clock=time.perf_counter, sleep=time.sleep):
        if rate_bps <= 0:
            raise ValueError(f"pacing rate {rate_bps} bit/s: must be positive")
        self.rate_bps = float(rate_bps)
        self.lag = burst_bytes * 8 / self.rate_bps  # how far behind the schedule it may catch up
        self._clock, self._sleep = clock, sleep
        self._next = clock()  # when the next byte is due
        self.forgotten_s = 0.0  # time behind beyond the bound, given up

    def restart(self) -> None:
        """A new schedule from now (after a pause that is no deficit, e.g. an off phase)."""
        self._next = self._clock()

    def wait(self, nbytes: int) -> None:
        """Return when `nbytes` more may be sent."""
        now = self._clock()
        if self._next > now:
            self._sleep(self._next - now)
        elif self._next < now - self.lag:
            self.forgotten_s += now - self.lag - self._next
            self._next = now - self.lag
        self._next += nbytes * 8 / self.rate_bps


SHAPING_MINOR = 0x100  # a gradient sender's htb class 1:0x100+i (background flows' are their ports)


def gradient_sender(t, mtu: int, dst: str, bind: str, index: int = 0) -> "Sender":
    """A node's sender of gradient packets to `dst` under its transport config `t`
    (`config.TransportConfig`): its DSCP, and its pacing rate held by the kernel where `t`
    allows shaping (the `index`-th shaped sender of the host)."""
    frame = mtu + wire.ETH_LEN  # what a qdisc counts of a full datagram: the IP packet and its Ethernet header
    return Sender(dst, t.port, t.dscp, rate_bps=t.pacing_bps, bind=bind, kernel_shaping=t.kernel_shaping,
                  shaping_minor=SHAPING_MINOR + index,
                  frame_over_payload=frame / (mtu - wire.ip_udp_overhead(":" in dst)))


class Sender:
    """Sends datagrams to one destination with a fixed DSCP, optionally paced to rate_bps
    of UDP payload. With `kernel_shaping` the kernel paces it (`kernel_pacing`: an htb
    class of its own, `shaping_minor`, on the virtual rack's host NIC; where the route's
    device has fq, SO_MAX_PACING_RATE): a shaped sender hands every datagram to the kernel
    at once, each a packet of its own (no GSO), and the class spaces them on the wire, so
    the rate holds however busy the host is. Otherwise user space paces it (`Pacer`, at
    most `burst_bytes` back to back), and a busy host's oversleeping shows as a lower rate.

    Unpaced, `send_all` and `send_frames` hand runs of equal-size datagrams (the last may
    be shorter) to the kernel as one UDP GSO message each (up to 64), all of a bucket's
    messages in one sendmmsg call (outside the GIL), every segment still a datagram of its
    own with its own trimlab header. The kernel segments in
    software before a device without UDP segmentation offload (the virtual rack's hosts),
    and lab NICs segment in hardware, so the switch never sees a super-packet."""

    def __init__(self, dst: str, port: int = GRADIENT_PORT, dscp: int = 0, ecn: int = 0,
                 rate_bps: float | None = None, sndbuf: int = BUFFER_BYTES, bind: str | None = None,
                 burst_bytes: int = 2 * 1500, kernel_shaping: bool = False, shaping_minor: int = SHAPING_MINOR,
                 frame_over_payload: float = 1.0):
        self.dst = (dst, port)
        self.sock = socket.socket(family(dst), socket.SOCK_DGRAM)
        self._name = _sockaddr(dst, port)  # sendmmsg's msg_name
        if bind:  # send from this address: receivers accept only known sources
            self.sock.bind((bind, 0))
        set_tos(self.sock, dscp, ecn)
        self.sndbuf = _set_buffers(self.sock, socket.SO_SNDBUF, sndbuf)
        self.rate_bps = rate_bps
        self.paced_by, self._shaped = None, None  # how the rate is held ("htb 1:…", "fq", None: user space)
        if rate_bps:
            self.paced_by, self._shaped = kernel_pacing(self.sock, dst, rate_bps, shaping_minor, frame_over_payload,
                                                        htb=kernel_shaping, burst_bytes=burst_bytes)
        # fq queues at most 100 packets a flow (and drops the rest): it still needs the user-space pacer
        self.pacer = Pacer(rate_bps, burst_bytes) if rate_bps and not self._shaped else None
        self.gso = True  # until the kernel says it cannot
        self.sent = 0
        self.bytes = 0
        self._later: _SendThread | None = None

    def send(self, payload: bytes) -> None:
        if self.pacer:
            self.pacer.wait(len(payload))
        self.sock.sendto(payload, self.dst)
        self.sent += 1
        self.bytes += len(payload)

    def send_all(self, payloads) -> None:
        if self.pacer or not self.gso:
            for p in payloads:
                self.send(p)
            return
        payloads = list(payloads)
        if payloads:
            length = np.array([len(p) for p in payloads], dtype=np.int64)
            data = np.zeros((len(payloads), int(length.max())), dtype=np.uint8)
            for i, p in enumerate(payloads):
                data[i, :len(p)] = np.frombuffer(p, dtype=np.uint8)
            self.send_frames(wire.Frames(data, length))

    def send_frames(self, frames, one_per_message: bool = False) -> None:
        """Send a `wire.Frames` (or any rows + lengths) from its array in sendmmsg calls,
        without the GIL and without a bytes object per packet: each run of `gso_runs` is
        one message, a UDP GSO super-datagram whose iovecs are its rows in place. A shaped
        sender, or `one_per_message`, sends each datagram as a message (a packet) of its own."""
        if self.pacer or not self.gso:
            for p in frames.payloads():
                self.send(p)
            return
        data, length = np.ascontiguousarray(frames.data), np.asarray(frames.length, dtype=np.int64)
        single = one_per_message or self._shaped is not None  # each its own packet in a qdisc's queue
        if single:
            runs = np.zeros(len(length), dtype=_RUNS)
            runs["first"], runs["rows"], runs["size"] = np.arange(len(length)), 1, length
        else:
            runs = gso_runs(length)
        iov = np.empty(len(length), dtype=_IOVEC)
        iov["base"] = data.ctypes.data + data.shape[1] * np.arange(len(length), dtype=np.uint64)
        iov["len"] = length
        ctl = np.zeros((len(runs), _CMSG_SPACE_U16), dtype=np.uint8)
        ctl[:, :8].view(np.uint64)[:, 0] = _CMSG_LEN_U16
        ctl[:, 8:12].view(np.int32)[:, 0] = socket.SOL_UDP
        ctl[:, 12:16].view(np.int32)[:, 0] = UDP_SEGMENT
        ctl[:, 16:18].view(np.uint16)[:, 0] = runs["size"]
        msgs = np.zeros(len(runs), dtype=_MMSG)
        msgs["name"], msgs["namelen"] = ctypes.addressof(self._name), ctypes.sizeof(self._name)
        msgs["iov"] = iov.ctypes.data + _IOVEC.itemsize * runs["first"].astype(np.uint64)
        msgs["iovlen"] = runs["rows"]
        msgs["control"] = ctl.ctypes.data + _CMSG_SPACE_U16 * np.arange(len(runs), dtype=np.uint64)
        msgs["controllen"] = 0 if single else _CMSG_SPACE_U16
        done = 0
        while done < len(runs):
            n = _LIBC.sendmmsg(self.sock.fileno(), msgs.ctypes.data + _MMSG.itemsize * done,
                               min(len(runs) - done, _UIO_MAXIOV), 0)
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOPROTOOPT, errno.EIO):
                    raise OSError(err, f"sendmmsg: {os.strerror(err)}")
                self.gso = False  # a kernel or route without UDP GSO: one datagram per call from here
                for i in range(int(runs["first"][done]), len(length)):
                    self.send(data[i, :length[i]].tobytes())
                return
            sent = runs[done:done + n]
            self.sent += int(sent["rows"].sum())
            self.bytes += int(length[int(sent["first"][0]):int(sent["first"][-1] + sent["rows"][-1])].sum())
            done += n

    def send_frames_later(self, frames) -> None:
        """`send_frames` on this sender's own thread, in order, so that the caller can
        encode the next bucket meanwhile: the kernel's work of sending (segmenting, the
        host's path) is charged to that thread, on another core. `frames` must stay as it
        is, and nothing else be sent through this sender, until `wait_sent` returns; at
        most two wait their turn (then this blocks)."""
        if self._later is None:
            self._later = _SendThread(self)
        self._later.put(frames)

    def wait_sent(self) -> None:
        """Until everything given to `send_frames_later` is sent; raises what sending raised."""
        if self._later is not None:
            self._later.wait()

    def close(self) -> None:
        if self._later is not None:
            self._later.stop()
            self._later = None
        if self._shaped:
            self._shaped.drain(self.sock, self.sndbuf, self.rate_bps)
            self._shaped.close()
            self._shaped = None
        self.sock.close()


class _SendThread:
    """A sender's own thread for `send_frames_later`: a short queue, and the first error."""

    def __init__(self, tx: Sender):
        self.tx, self.error = tx, None
        self.queue: queue.Queue = queue.Queue(maxsize=2)
        self.thread = threading.Thread(target=self._run, name=f"send to {tx.dst[0]}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (frames := self.queue.get()) is not None:
            try:
                if self.error is None:
                    self.tx.send_frames(frames)
            except BaseException as e:  # noqa: BLE001 (handed to the caller by wait or put)
                self.error = e
            finally:
                self.queue.task_done()
        self.queue.task_done()

    def _raise(self) -> None:
        if self.error is not None:
            e, self.error = self.error, None
            raise e

    def put(self, frames) -> None:
        self._raise()
        self.queue.put(frames)

    def wait(self) -> None:
        self.queue.join()
        self._raise()

    def stop(self) -> None:
        self.queue.put(None)
        self.thread.join()


@dataclass
class Datagram:
    payload: bytes
    src: tuple
    tos: int  # the TOS / traffic class byte as received (-1 if the kernel gave none)
    time_ns: int

    @property
    def dscp(self) -> int:
        return self.tos >> 2 if self.tos >= 0 else -1


@dataclass
class Batch:
    """Datagrams of one recvmmsg call, as arrays. `data` is the receiver's own buffer: the
    next call overwrites it, so copy what you keep; bytes of a row past its `length` are
    left over from earlier datagrams."""

    data: np.ndarray  # (n, slot) uint8, each datagram from byte 0
    length: np.ndarray  # (n,) int64: bytes received (the whole datagram unless `truncated`)
    truncated: np.ndarray  # (n,) bool: longer than a slot, cut by the receiver itself
    tos: np.ndarray  # (n,) int64: TOS / traffic class byte as received, -1 if none came
    addr: np.ndarray  # (n, 16) uint8: source address (IPv4 in the first 4 bytes)
    port: np.ndarray  # (n,) int64: source port
    time_ns: int  # when the batch was read
    v6: bool  # the receiving socket's family

    def __len__(self) -> int:
        return len(self.length)

    @property
    def dscp(self) -> np.ndarray:
        return np.where(self.tos >= 0, self.tos >> 2, -1)

    def src(self, i: int) -> str:
        raw = self.addr[i].tobytes()
        return socket.inet_ntop(socket.AF_INET6, raw) if self.v6 else socket.inet_ntop(socket.AF_INET, raw[:4])


def packed_addr(addr: str) -> np.ndarray:
    """An address as `Batch.addr` holds it (16 bytes, IPv4 in the first 4)."""
    raw = socket.inet_pton(family(addr), addr)
    return np.frombuffer(raw.ljust(16, b"\0"), dtype=np.uint8)


# struct mmsghdr / iovec on LP64 Linux (x86-64, arm64): msghdr is 56 bytes, msg_len follows
_MMSG = np.dtype({"names": ["name", "namelen", "iov", "iovlen", "control", "controllen", "flags", "len"],
                  "formats": ["u8", "u4", "u8", "u8", "u8", "u8", "i4", "u4"],
                  "offsets": [0, 8, 16, 24, 32, 40, 48, 56], "itemsize": 64})
_IOVEC = np.dtype({"names": ["base", "len"], "formats": ["u8", "u8"], "offsets": [0, 8], "itemsize": 16})
_NAME, _CONTROL = 28, 32  # sockaddr_in6; one cmsghdr (16 bytes) and its int
_MSG_DONTWAIT, _MSG_TRUNC = 0x40, 0x20
_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.recvmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_void_p]
_LIBC.recvmmsg.restype = ctypes.c_int
_LIBC.sendmmsg.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int]
_LIBC.sendmmsg.restype = ctypes.c_int
_UIO_MAXIOV = 1024  # messages per sendmmsg call
_CMSG_LEN_U16, _CMSG_SPACE_U16 = 18, 24  # a cmsghdr (16 bytes) carrying one u16 (UDP_SEGMENT)
_RUNS = np.dtype([("first", "i8"), ("rows", "i8"), ("size", "i8")])
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # malloc.h: mallopt's parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit (4 Mi × sizeof(long))


def hold_heap() -> bool:
    """Keep freed memory for the next allocation instead of giving it back to the kernel
    (glibc malloc; False elsewhere). Every step frees and allocates the same large buffers
    again (a bucket's bodies, its decoded tensor, the frames a worker sends); by default
    glibc serves them from fresh mappings, or trims them off the heap, and each first touch
    page-faults: 6 % of the ps's receive-and-decode time by perf (`trimlab bench
    transport`). Process-wide, so only entry points call it (the agents', the benches')."""
    mallopt = getattr(_LIBC, "mallopt", None)
    if mallopt is None:
        return False
    # an explicit threshold also stops glibc adapting both thresholds to what was freed
    return bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, 1 << 30))


def _sockaddr(host: str, port: int) -> ctypes.Array:
    """struct sockaddr_in / sockaddr_in6 for `host`, as bytes the kernel reads."""
    if family(host) == socket.AF_INET6:
        raw = (struct.pack("=H", socket.AF_INET6) + struct.pack("!HI", port, 0)
               + socket.inet_pton(socket.AF_INET6, host) + struct.pack("=I", 0))
    else:
        raw = struct.pack("=H", socket.AF_INET) + struct.pack("!H", port) + socket.inet_pton(socket.AF_INET, host) + bytes(8)
    return ctypes.create_string_buffer(raw, len(raw))


def gso_runs(length: np.ndarray) -> np.ndarray:
    """The GSO sends of datagrams of these lengths, in order: runs of equal length (at most
    64 and 65,000 bytes), a run that has room ended by one shorter datagram (GSO's last
    segment may be short). Rows `first` .. `first + rows`, segment `size`."""
    n = len(length)
    edges = np.flatnonzero(np.diff(length)) + 1
    starts, ends = np.concatenate([[0], edges]), np.concatenate([edges, [n]])
    runs: list[tuple[int, int, int]] = []
    i = 0
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        lo = max(lo, i)  # the segment's first row may have ended the run before
        if lo >= hi:
            continue
        size = int(length[lo])
        per_run = max(1, min(GSO_MAX_SEGMENTS, GSO_MAX_BYTES // size))
        firsts = list(range(lo, hi, per_run))
        runs += [(f, min(per_run, hi - f), size) for f in firsts]
        i = hi
        f, rows, _ = runs[-1]
        if hi < n and rows < per_run and length[hi] < size and rows * size + length[hi] <= GSO_MAX_BYTES:
            runs[-1] = (f, rows + 1, size)
            i = hi + 1
    return np.array(runs, dtype=_RUNS)


class Receiver:
    """A bound UDP socket that hands back batches of datagrams with their seen TOS; with
    `dscp`, replies sent from it (`sendto`) carry that DSCP. One recvmmsg call reads up to
    `batch` datagrams of at most `slot` bytes into preallocated arrays (`recv_many`); the
    default is the kernel's cap (UIO_MAXIOV), as a batch's fixed numpy cost is most of a
    small one's."""

    def __init__(self, bind: str = "0.0.0.0", port: int = GRADIENT_PORT, rcvbuf: int = BUFFER_BYTES,
                 dscp: int | None = None, slot: int = 9216, batch: int = 1024):
        self.sock = socket.socket(family(bind), socket.SOCK_DGRAM)
        if dscp is not None:
            set_tos(self.sock, dscp)
        self.v6 = family(bind) == socket.AF_INET6
        if self.v6:
            self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_RECVTCLASS, 1)
        else:
            self.sock.setsockopt(socket.IPPROTO_IP, socket.IP_RECVTOS, 1)
        self.rcvbuf = _set_buffers(self.sock, socket.SO_RCVBUF, rcvbuf)
        # replies (a reliable broadcast's chunks, ACKs) queue here rather than fail while
        # the host's port drains them
        self.sndbuf = _set_buffers(self.sock, socket.SO_SNDBUF, BUFFER_BYTES)
        self.sock.bind((bind, port))
        self.sock.setblocking(False)
        self.port = self.sock.getsockname()[1]
        self._buf = np.zeros((batch, slot), dtype=np.uint8)
        self._names = np.zeros((batch, _NAME), dtype=np.uint8)
        self._control = np.zeros((batch, _CONTROL), dtype=np.uint8)
        self._iov = np.zeros(batch, dtype=_IOVEC)
        self._iov["base"] = self._buf.ctypes.data + slot * np.arange(batch, dtype=np.uint64)
        self._iov["len"] = slot
        self._msgs = np.zeros(batch, dtype=_MMSG)
        self._msgs["name"] = self._names.ctypes.data + _NAME * np.arange(batch, dtype=np.uint64)
        self._msgs["iov"] = self._iov.ctypes.data + _IOVEC.itemsize * np.arange(batch, dtype=np.uint64)
        self._msgs["iovlen"] = 1
        self._msgs["control"] = self._control.ctypes.data + _CONTROL * np.arange(batch, dtype=np.uint64)
        # the TOS arrives as one byte (IPv4) or an int (IPv6 traffic class), after the cmsghdr
        self._tos_level, self._tos_type = ((socket.IPPROTO_IPV6, socket.IPV6_TCLASS) if self.v6
                                           else (socket.IPPROTO_IP, socket.IP_TOS))

    def recv_many(self, timeout: float | None = 0.1, max_packets: int | None = None) -> Batch | None:
        """Wait up to `timeout` for the first datagram, then read what is queued (at most
        `max_packets`, and what the buffers hold) in one system call; None if nothing came."""
        if timeout != 0 and not select.select([self.sock], [], [], timeout)[0]:
            return None
        want = min(max_packets or len(self._msgs), len(self._msgs))
        msgs = self._msgs[:want]
        msgs["namelen"], msgs["controllen"] = _NAME, _CONTROL  # the kernel overwrites both
        n = _LIBC.recvmmsg(self.sock.fileno(), self._msgs.ctypes.data, want, _MSG_DONTWAIT, None)
        if n < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR):
                return None
            raise OSError(err, f"recvmmsg: {os.strerror(err)}")
        if n == 0:
            return None
        now = time.time_ns()
        msgs = self._msgs[:n]
        ctl = self._control[:n]
        level = ctl[:, 8:12].copy().view(np.int32)[:, 0]
        kind = ctl[:, 12:16].copy().view(np.int32)[:, 0]
        value = ctl[:, 16:20].copy().view(np.int32)[:, 0] if self.v6 else ctl[:, 16].astype(np.int32)
        has = (msgs["controllen"] >= 17) & (level == self._tos_level) & (kind == self._tos_type)
        names = self._names[:n]
        if self.v6:
            addr = np.ascontiguousarray(names[:, 8:24])
        else:
            addr = np.zeros((n, 16), dtype=np.uint8)
            addr[:, :4] = names[:, 4:8]
        port = names[:, 2].astype(np.int64) << 8 | names[:, 3]
        return Batch(self._buf[:n], msgs["len"].astype(np.int64), (msgs["flags"] & _MSG_TRUNC) != 0,
                     np.where(has, value & 0xFF, -1).astype(np.int64), addr, port, now,
                     self.v6)

    def recv_batch(self, max_packets: int = 512, timeout: float | None = 0.1) -> list[Datagram]:
        """`recv_many` as one `Datagram` object per datagram (for low rates: control, tools)."""
        b = self.recv_many(timeout, max_packets)
        if b is None:
            return []
        return [Datagram(b.data[i, :b.length[i]].tobytes(), (b.src(i), int(b.port[i])), int(b.tos[i]), b.time_ns)
                for i in range(len(b))]

    def sendto(self, payload: bytes, addr: tuple) -> bool:
        """Send; False when the socket buffer is full (as good as a loss on the wire)."""
        try:
            self.sock.sendto(payload, addr)
            return True
        except BlockingIOError:
            return False

    def unsent_bytes(self) -> int:
        """Bytes this socket handed the kernel that have not left the host yet."""
        return unsent_bytes(self.sock)

    def close(self) -> None:
        self.sock.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trimlab.agents.transport", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("send", help="send numbered datagrams")
    s.add_argument("--dst", required=True)
    s.add_argument("--port", type=int, default=GRADIENT_PORT)
    s.add_argument("--dscp", type=int, default=0)
    s.add_argument("--ecn", type=int, default=0)
    s.add_argument("--count", type=int, default=100)
    s.add_argument("--size", type=int, default=1000, help="payload bytes, sequence number included")
    s.add_argument("--rate", type=float, default=None, help="pace to this many bits/s")
    s.add_argument("--kernel-shaping", action="store_true",
                   help="with --rate: shape in an htb class of its own under the host NIC's class 1:1 (the virtual "
                        "rack's hosts; needs CAP_NET_ADMIN)")
    r = sub.add_parser("recv", help="print {\"listening\": PORT} once bound, then one JSON line per datagram")
    r.add_argument("--bind", default="0.0.0.0")
    r.add_argument("--port", type=int, default=GRADIENT_PORT)
    r.add_argument("--idle", type=float, default=1.0, help="stop after this many idle seconds")
    a = ap.parse_args(argv)
    if a.cmd == "send":
        tx = Sender(a.dst, a.port, a.dscp, a.ecn, a.rate, kernel_shaping=a.kernel_shaping,
                    frame_over_payload=(a.size + wire.ip_udp_overhead(":" in a.dst) + wire.ETH_LEN) / a.size)
        pad = b"\0" * max(0, a.size - _SEQ.size)
        t0 = time.monotonic()
        tx.send_all(_SEQ.pack(i & 0xFFFFFFFF) + pad for i in range(a.count))
        handed_s = time.monotonic() - t0
        tx.close()  # a shaped sender's backlog leaves first
        print(json.dumps({"sent": tx.sent, "bytes": tx.bytes, "sndbuf": tx.sndbuf, "handed_s": round(handed_s, 6),
                          "paced_by": tx.paced_by or ("user space" if a.rate else None)}))
        return 0
    rx = Receiver(a.bind, a.port)
    print(json.dumps({"listening": a.port}), flush=True)  # bound: a sender may start
    while batch := rx.recv_batch(timeout=a.idle):
        for d in batch:
            seq = _SEQ.unpack_from(d.payload)[0] if len(d.payload) >= _SEQ.size else -1
            print(json.dumps({"seq": seq, "len": len(d.payload), "dscp": d.dscp, "tos": d.tos,
                              "src": d.src[0]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
