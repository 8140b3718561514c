"""torch DDP through trimming switches: a communication hook that moves each gradient
bucket over trimlab's trimmable UDP transport, while torch.distributed (gloo, over the
management network) keeps rendezvous and control. An existing DDP script adds one line:

    ddp.register_comm_hook(TrimlabState.from_env(), trimlab_hook)

Per bucket: reduce-scatter over trimmable packets (rank k owns the k-th shard of every
bucket; every other rank sends it that shard with the run's codec), the owner decodes what
arrived at whatever precision it arrived, averages per coordinate over the contributions
that arrived (its own is exact), and the averaged shards are all-gathered reliably on the
control class (trimlab.agents.collective's sharded all-reduce), so every rank applies identical
gradients. CUDA buckets are copied to host memory and back.

Communication overlaps backward: the hook hands its bucket to the rank's communication
thread and returns a future at once; the thread runs the buckets' all-reduces in DDP's
order (the same on every rank) and completes each future, while autograd computes the
next buckets' gradients (the codec kernels and the sockets release the GIL). Each step's
metrics row holds the time of every phase (trimlab.config.PHASES).

Environment: TRIMLAB_CONFIG (the agents' configuration that `trimlab run` writes: codec,
transport, job, seed, every rank's data address), RANK (torchrun's), and optionally
TRIMLAB_OUT, a directory for packets.csv, metrics.csv, layout.json, truth/ and final.json,
the files the native agents write, so the same analysis and report apply.

Without TRIMLAB_CONFIG (a plain `torchrun`, before any rack exists), the configuration
comes from torch.distributed's rendezvous: every rank takes an address on TRIMLAB_IFACE
(default `lo`: rank r on 127.0.0.(r + 2), so one machine's ranks stay apart), the ranks
exchange addresses, and the codec is the default one (embedded, B for the interface's MTU,
at most 1500); rank 0 says so once.
"""


import atexit
import hashlib
import os
import queue
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from trimlab import rundir
from trimlab.agents import logs
from trimlab.agents.collective import ShardedAllReduce, shard_bounds
from trimlab.config import METRIC_FIELDS, PHASES, AgentConfig
from trimlab.errors import TrimlabError


class HookError(TrimlabError):
    """The hook cannot start (missing environment, a rank outside the configuration)."""


def _interface(iface: str) -> tuple[str, int]:
    """The first IPv4 address and the MTU of a network interface."""
    import fcntl
    import socket
    import struct
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        name = struct.pack("256s", iface.encode()[:15])
        try:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, name)[20:24])  # SIOCGIFADDR
            mtu = struct.unpack("i", fcntl.ioctl(s.fileno(), 0x8921, name)[16:20])[0]  # SIOCGIFMTU
        except OSError as exc:
            raise HookError(f"TRIMLAB_IFACE={iface}: no IPv4 address on that interface ({exc.strerror}); "
                            "name the interface that reaches the other ranks, or set TRIMLAB_CONFIG") from None
    return addr, mtu


def rendezvous_config(iface: str = "lo") -> AgentConfig:
    """A configuration for a plain torchrun: every rank's address on `iface`, exchanged
    through torch.distributed (which must be initialized), and trimlab's defaults."""
    from trimlab import wire
    from trimlab.codec import get_codec
    from trimlab.config import CodecConfig, HostConfig, TransportConfig, WorkloadConfig
    if not dist.is_initialized():
        raise HookError("TRIMLAB_CONFIG is not set and torch.distributed is not initialized: call "
                        "dist.init_process_group first (torchrun sets its environment), or set TRIMLAB_CONFIG "
                        "to the agents' configuration (trimlab run does)")
    rank, world = dist.get_rank(), dist.get_world_size()
    addr, mtu = _interface(iface)
    if iface == "lo":
        addr, mtu = f"127.0.{(rank + 2) >> 8}.{(rank + 2) & 0xFF}", 1500
    elif int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > 1:
        raise HookError(f"TRIMLAB_IFACE={iface}: {os.environ['LOCAL_WORLD_SIZE']} ranks on this host would share "
                        f"{addr}; run one rank per host there, or TRIMLAB_IFACE=lo on one machine")
    addrs: list = [None] * world
    dist.all_gather_object(addrs, addr)
    mtu = min(mtu, 1500)
    codec = get_codec("embedded")
    cfg = AgentConfig(name="torchrun", job=1, seed=0, steps=0, mtu=mtu, topology="sharded",
                      workload=WorkloadConfig(kind="ddp"),
                      codec=CodecConfig(name="embedded", span=4096, coords=min(wire.max_coords(codec, mtu), 4096)),
                      transport=TransportConfig(dscp=10, control_dscp=46, deadline_ms=200.0), workers=[HostConfig(name=f"rank{r}", addr=a)
                                                            for r, a in enumerate(addrs)])
    if rank == 0:
        print(f"trimlab: TRIMLAB_CONFIG is not set: {world} ranks exchange gradients over {iface} "
              f"({', '.join(addrs[:4])}{' ...' if world > 4 else ''}) with codec embedded, port "
              f"{cfg.transport.port}; set TRIMLAB_CONFIG (trimlab run) to run through a rack", file=sys.stderr,
              flush=True)
    return cfg


class TrimlabState:
    """The sharded all-reduce, codec and logs of one rank; the hook's state."""

    def __init__(self, cfg: AgentConfig, rank: int, out: Path | None = None):
        self.cfg, self.rank = cfg, rank
        self.world = len(cfg.workers)
        if not 0 <= rank < self.world:
            raise HookError(f"RANK={rank}: the trimlab configuration has ranks 0..{self.world - 1}")
        self.ar = ShardedAllReduce(cfg, rank)
        self.node = self.ar.node
        self.truth_every = cfg.truth_every
        self.step = 0
        self.digest = hashlib.sha256()  # of every averaged gradient: equal on all ranks iff identical
        self.t0 = time.monotonic()
        self.out = out
        self.closed = False
        self._step_stats()
        self.layouts: list[dict] = []  # per step: wire bucket -> [lo, hi) in the step's gradient
        if out is not None:
            (out / rundir.TRUTH).mkdir(parents=True, exist_ok=True)
            self.plog = logs.PacketLog(out / rundir.PACKET_LOG)
            self.mlog = logs.MetricsLog(out / rundir.METRICS, METRIC_FIELDS)
        self._jobs: queue.Queue = queue.Queue()
        self._failed: BaseException | None = None
        self._comm = threading.Thread(target=self._serve, name=f"trimlab-comm-{rank}", daemon=True)
        self._comm.start()

    @classmethod
    def from_env(cls) -> "TrimlabState":
        path = os.environ.get("TRIMLAB_CONFIG")
        rank = int(os.environ.get("RANK", dist.get_rank() if dist.is_initialized() else 0))
        out = os.environ.get("TRIMLAB_OUT")
        cfg = AgentConfig.read(path) if path else rendezvous_config(os.environ.get("TRIMLAB_IFACE", "lo"))
        state = cls(cfg, rank, Path(out) if out else None)
        if dist.is_initialized():
            dist.barrier()  # every rank's sockets are bound before anyone sends a gradient
        atexit.register(state.close)
        return state

    def _step_stats(self) -> None:
        self.sq = 0.0
        self.offset = 0  # where the next bucket starts in the step's flat gradient
        self.parts: list[torch.Tensor] = []  # this step's exact buckets, when truth is saved
        self.buckets: dict[int, list[int]] = {}
        self.owners: dict[int, int] = {}

    def submit(self, grad: torch.Tensor, index: int, last: bool) -> torch.futures.Future:
        """Queue bucket `index` for the communication thread; the future completes with the
        bucket's mean over all ranks (in `grad`'s device and dtype)."""
        # a CUDA bucket's future records an event when the result is set and makes its
        # waiter's stream wait on it: the result's copy back runs on this thread's stream
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(
            devices=[grad.device] if grad.is_cuda else None)
        if grad.is_cuda:  # one copy into page-locked host memory, where the sockets read
            flat = torch.empty(grad.numel(), dtype=torch.float32, pin_memory=True)
            flat.copy_(grad.detach().reshape(-1))  # on the caller's stream, after the gradients
        else:
            flat = grad.detach().reshape(-1).to(torch.float32)
        self._jobs.put((flat, grad, index, last, fut))
        return fut

    def _serve(self) -> None:
        """The communication thread: buckets in submission order until close(). Between
        buckets it keeps pumping the sockets: a peer may still need our retransmissions or
        ACKs, and DDP's next gloo collective would otherwise wait on it forever."""
        while True:
            try:
                job = self._jobs.get(timeout=0.005)
            except queue.Empty:
                if self._failed is None:
                    try:
                        self.node.pump(0.005)
                    except BaseException as exc:  # noqa: BLE001 — the next bucket's future reports it
                        self._failed = exc
                continue
            if job is None:
                return
            flat, grad, index, last, fut = job
            if self._failed is not None:  # a failed all-reduce leaves the protocol out of step
                fut.set_exception(self._failed)
                continue
            try:
                out = self.allreduce(flat, index)
                if last:
                    self.end_step()
                fut.set_result(out.to(grad.device, grad.dtype).view_as(grad))
            except BaseException as exc:  # noqa: BLE001 — handed to DDP through the future
                self._failed = exc
                fut.set_exception(exc)

    def allreduce(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """The mean of `flat` (this rank's bucket `index`, float32 on the CPU) over all ranks."""
        numel = flat.numel()
        mean, rows = self.ar.reduce_scatter(flat, self.step, index)
        if self.out is not None:
            self.plog.write(rows)
        out = self.ar.all_gather(mean, self.step, numel, index, compress=self.cfg.compress_gather)
        self.digest.update(out.numpy().tobytes())
        self._record_bucket(flat, index)
        return out

    def _record_bucket(self, flat: torch.Tensor, index: int) -> None:
        """Where this bucket's shards sit in the step's gradient (for layout.json and truth)."""
        base = self.offset
        for owner, (lo, hi) in enumerate(shard_bounds(flat.numel(), self.world)):
            if hi > lo and owner != self.rank:
                b = self.ar.wire_bucket(index, owner)
                self.buckets[b] = [base + lo, base + hi]
                self.owners[b] = owner
        self.offset += flat.numel()
        if self._saves_truth():  # a copy: `flat` may alias the bucket DDP overwrites with the mean
            self.parts.append(flat.clone())
        self.sq += float(flat.double().pow(2).sum())

    def _saves_truth(self) -> bool:
        return self.out is not None and bool(self.truth_every) and self.step % self.truth_every == 0

    def end_step(self) -> None:
        """After the step's last bucket: metrics, truth, layout; the next step begins."""
        s = self.ar.take_stats()
        if self.out is not None:
            if self.parts:
                np.save(self.out / rundir.TRUTH / rundir.truth_file(self.step, self.rank),
                        torch.cat(self.parts).numpy())
            self.mlog.write(step=self.step, t=round(time.monotonic() - self.t0, 4), loss="",
                            grad_norm=round(self.sq ** 0.5, 6), packets=s["packets"], bytes=s["bytes"],
                            **{p: round(s[p], 2) for p in PHASES})
            self.layouts.append({"buckets": self.buckets, "owners": self.owners, "numel": self.offset})
        self.step += 1
        self._step_stats()

    def close(self) -> None:
        """Deliver what is still unacknowledged, answer peers' retransmissions for a moment,
        and write layout.json and final.json. Runs at exit; idempotent."""
        if self.closed:
            return
        self.closed = True
        self._jobs.put(None)  # the buckets already queued are reduced first
        self._comm.join()
        self.ar.close()
        if self.out is None:
            return
        self.plog.close()
        self.mlog.close()
        last = self.layouts[-1] if self.layouts else {"buckets": {}, "owners": {}, "numel": 0}
        differ = {i: lay for i, lay in enumerate(self.layouts) if lay["buckets"] != last["buckets"]}
        rundir.GradientLayout(  # DDP rebuilds its buckets after the first step: those steps' own
            numel=last["numel"], rank=self.rank, topology="ddp", buckets=last["buckets"], owners=last["owners"],
            buckets_by_step={i: lay["buckets"] for i, lay in differ.items()},
            owners_by_step={i: lay["owners"] for i, lay in differ.items()}).write(self.out)
        rundir.Final(role="worker", rank=self.rank, steps=self.step, checksum=self.digest.hexdigest()[:16],
                     wall_s=time.monotonic() - self.t0, discarded=dict(self.node.discarded)).write(self.out)


def trimlab_hook(state: TrimlabState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over every rank through the
    trimmable transport, on the rank's communication thread while backward goes on."""
    return state.submit(bucket.buffer(), bucket.index(), bucket.is_last())
