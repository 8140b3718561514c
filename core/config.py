"""The agents' configuration: one typed model that the controller writes (agent.json) and
that every agent, the DDP hook, the benches and the analysis read. The ports, timeouts and
the columns of the agents' CSV files are declared here, once."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from trimlab.errors import SpecError

REMOTE_ROOT = "/var/tmp/trimlab"  # on every host: one folder per run, the agents' files
GRADIENT_PORT = 47000  # gradient packets; the reliable control channel is GRADIENT_PORT + 1
STREAM_PORT_OFFSET = 2  # the sharded all-gather's TCP streams: the gradient port + 2
TRAFFIC_PORT = 48000  # background flow i: TRAFFIC_PORT + i
RENDEZVOUS_PORT = 29500  # torch.distributed's rendezvous at rank 0, on the management network

# columns of the agents' CSV files
PACKET_LOG_FIELDS = ("t_ns", "src", "dscp", "step", "rank", "bucket", "span", "packet", "coords",
                     "sent_len", "recv_len", "trimmed", "planes", "status")
# per step: the all-reduce's phases, summed over its buckets (encode and send the shards,
# wait for peers' packets, decode and average, all-gather the averaged shards)
PHASES = ("encode_ms", "send_ms", "wait_ms", "decode_ms", "gather_ms")
METRIC_FIELDS = ("step", "t", "loss", "grad_norm", "packets", "bytes", *PHASES)
STEP_FIELDS = ("step", "t", "wait_ms", "reduce_ms", "received", "expected", "trimmed", "missing",
               "min_contributors", "retransmits", "test_loss", "test_acc")

def parse_rate(rate: str) -> int:
    """'1gbit', '100mbit', '10g', '2500000' → bits per second."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)(?:bit|bps|b)?\s*", rate.lower())
    if not m:
        raise SpecError(f"rate={rate!r}: use a number with kbit, mbit or gbit (e.g. 1gbit)")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkloadConfig(_Strict):
    """What to train; also the spec's `workload:` section."""

    kind: Literal["digits", "synthetic", "mnist1d", "cifar10", "cifar100", "custom", "ddp"] = Field(
        "digits", description="what trains: a dataset with trimlab's agents, a custom model, or a DDP script (ddp)")
    data: Literal["digits", "mnist1d"] = Field("digits", description="ddp: the dataset the DDP script trains on")
    model: Literal["mlp", "cnn"] = Field("mlp", description="the model (cnn: 1-D for sequences)")
    width: int | None = Field(None, ge=1, le=4096, description="the model's size: hidden units (mlp, default "
                              "128), channels of each conv layer (cnn; default 25 on sequences, 16 on images)")
    steps: int = Field(100, ge=1, le=1_000_000, description="training steps")
    batch: int = Field(64, ge=1, le=65536, description="samples a worker takes each step")
    time_limit_s: float | None = Field(None, gt=0, description="ddp: training stops at the first evaluation past "
                                       "this many seconds (a point too slow to reach its target says so)")
    lr: float = Field(0.1, gt=0, le=10, description="SGD learning rate")
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum")
    eval_every: int = Field(10, ge=1, description="test accuracy every N steps (and at the end)")
    factory: str | None = Field(None, description="custom: 'package.module:function' returning a torch module")
    dataset: str | None = Field(None, description="custom: path to a local dataset; cifar10/cifar100: the "
                                                   "directory holding torchvision's cifar-10-batches-py/ "
                                                   "or cifar-100-python/")
    script: str | None = Field(None, description="ddp: a torch DDP script that registers trimlab's comm "
                                                 "hook (default: examples/ddp_train.py), the same path on every host")
    comm: Literal["trimlab", "gloo"] = Field("trimlab", description="ddp: trimlab's comm hook (trimmable UDP), "
                                             "or DDP's own gloo all-reduce over TCP through the same switch "
                                             "(DSCP 0: the stock reliable path, its queue dropping)")

    @model_validator(mode="after")
    def _custom(self):
        if self.script and self.kind != "ddp":
            raise SpecError("workload.script only applies to workload.kind=ddp")
        if self.comm != "trimlab" and self.kind != "ddp":
            raise SpecError("workload.comm only applies to workload.kind=ddp (agents always use trimlab)")
        if self.kind == "custom" and not (self.factory and self.dataset):
            raise SpecError("workload.kind=custom needs workload.factory (module:function) and "
                            "workload.dataset (a local path)")
        if self.kind in ("cifar10", "cifar100") and not self.dataset:
            raise SpecError(f"workload.kind={self.kind} needs workload.dataset: the local directory holding "
                            "torchvision's CIFAR files (nothing is downloaded)")
        if self.time_limit_s and self.kind != "ddp":
            raise SpecError("workload.time_limit_s only applies to workload.kind=ddp (the DDP script stops its "
                            "ranks together; trimlab's agents run every step)")
        if self.width and self.kind == "custom":
            raise SpecError("workload.width does not apply to workload.kind=custom (its factory builds the model)")
        if self.factory and self.kind != "custom":
            raise SpecError("workload.factory only applies to workload.kind=custom")
        if self.dataset and self.kind not in ("custom", "cifar10", "cifar100"):
            raise SpecError("workload.dataset only applies to workload.kind=custom, cifar10 or cifar100")
        if self.factory and ":" not in self.factory:
            raise SpecError(f"workload.factory={self.factory!r}: use 'package.module:function'")
        return self


class CodecConfig(_Strict):
    name: str
    params: dict[str, Any] = Field(default_factory=dict)
    span: int
    coords: int


class TransportConfig(_Strict):
    dscp: int = Field(ge=0, le=63)
    control_dscp: int = Field(ge=0, le=63)
    deadline_ms: float = Field(gt=0)
    pacing_bps: int | None = None
    kernel_shaping: bool = False  # the host NIC's htb is ours to add classes to (the virtual rack)
    port: int = GRADIENT_PORT
    ipv6: bool = False

    @property
    def control_port(self) -> int:
        return self.port + 1

    @property
    def stream_port(self) -> int:
        """The all-gather's TCP connections (trimlab.agents.stream)."""
        return self.port + STREAM_PORT_OFFSET


class Timeouts(_Strict):
    startup_s: float = 90.0  # the first step: every agent still starting
    step_s: float = 30.0  # no gradient packet of a step at all
    params_s: float = 30.0  # parameters (or averaged shards) not complete
    give_up_s: float = 10.0  # a peer that stopped acknowledging


class HostConfig(_Strict):
    name: str
    addr: str  # data-network address: the only source a receiver accepts from this host


class AgentConfig(_Strict):
    """Everything an agent needs to take part in one run."""

    name: str
    job: int = Field(ge=0, le=0xFFFF)
    seed: int
    steps: int
    mtu: int
    topology: Literal["ps", "sharded"]
    workload: WorkloadConfig
    codec: CodecConfig
    transport: TransportConfig
    truth_every: int = Field(0, ge=0, description="save the exact gradient every N steps (0: never)")
    eval_every: int = 10
    ps: HostConfig | None = None
    workers: list[HostConfig] = Field(min_length=1)
    timeouts: Timeouts = Field(default_factory=Timeouts)
    max_missed_steps: int = 3
    compress_gather: bool = Field(True, description="the DDP hook all-gathers averaged shards as the codec's "
                                  "untrimmed packets where that is smaller than float32")

    @model_validator(mode="after")
    def _roles(self):
        if self.topology == "ps" and self.ps is None:
            raise SpecError("agent configuration: topology ps needs a ps host")
        return self

    def check_rank(self, rank: int) -> None:
        if not 0 <= rank < len(self.workers):
            raise SpecError(f"rank {rank}: the trimlab configuration has ranks 0..{len(self.workers) - 1}")

    def write(self, path: Path) -> None:
        path.write_text(self.model_dump_json(indent=2) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> "AgentConfig":
        """agent.json; a missing or invalid file is one SpecError line naming the field."""
        try:
            return cls.model_validate_json(Path(path).read_text())
        except FileNotFoundError:
            raise SpecError(f"agent configuration {path}: no such file") from None
        except ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            raise SpecError(f"agent configuration {path}: {where}: {err['msg']}") from None
