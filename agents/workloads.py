"""Training workloads that need no download, and the flat-parameter view the protocol uses.

- digits: scikit-learn's handwritten digits (1797 8x8 images, shipped inside the package),
  a seeded 80/20 split.
- synthetic: a teacher–student task: a fixed random teacher MLP labels Gaussian inputs.
- mnist1d: MNIST-1D (Greydanus & Kobak), generated procedurally by the `mnist1d` package
  (10 000 sequences of 40 values, its own 80/20 split; no download), cached per machine.
  Hard enough to tell optimizers apart: the small CNN reaches about 90 %, an MLP far less.
- cifar10 / cifar100: from `workload.dataset`, a local directory in torchvision's layout
  (cifar-10-batches-py/ or cifar-100-python/, the pickled batches; no torchvision needed).
- custom: `workload.factory` ('package.module:function' returning a torch module) and
  `workload.dataset`, a local .pt (torch.save) or .npz file with x_train, y_train,
  x_test, y_test (classification, integer labels).

Models: `mlp` (one hidden layer) and `cnn` (two conv layers, 1-D for sequences) for the
dataset's input shape.
Every rank draws its own batches deterministically from (seed, rank, step).
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from trimlab.config import WorkloadConfig
from trimlab.errors import SpecError

IMAGE = (1, 8, 8)  # digits' shape; synthetic inputs use it too so both models fit both


@dataclass
class Workload:
    model: nn.Module
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    def batch(self, seed: int, rank: int, world: int, step: int, size: int):
        """This rank's batch of `step`: drawn from its 1/world shard of the training set."""
        shard = torch.arange(rank, len(self.x_train), world)
        g = torch.Generator().manual_seed(_mix(seed, rank, step))
        idx = shard[torch.randint(len(shard), (size,), generator=g)]
        return self.x_train[idx], self.y_train[idx]

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(self.model(x), y)

    @torch.no_grad()
    def evaluate(self) -> tuple[float, float]:
        """(test loss, test accuracy)."""
        self.model.eval()
        out = self.model(self.x_test)
        self.model.train()
        return (float(nn.functional.cross_entropy(out, self.y_test)),
                float((out.argmax(1) == self.y_test).float().mean()))


def _mix(*values: int) -> int:
    h = hashlib.blake2b(repr(values).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def make_model(kind: str, in_shape=IMAGE, classes: int = 10, width: int | None = None) -> nn.Module:
    """`width`: the hidden layer's units (mlp, default 128), each 1-D conv's channels (cnn
    on sequences, default 25: MNIST-1D's CNN), the first 2-D conv's channels (cnn on
    images, default 16; the second has twice as many)."""
    if kind == "mlp":
        n, h = 1, width or 128
        for d in in_shape:
            n *= d
        return nn.Sequential(nn.Flatten(), nn.Linear(n, h), nn.ReLU(), nn.Linear(h, classes))
    if kind == "cnn" and len(in_shape) == 2:  # sequences (channels, length): MNIST-1D's CNN shape
        (c, n), k = in_shape, width or 25
        for _ in range(3):
            n = (n + 2 - 5) // 2 + 1
        return nn.Sequential(nn.Conv1d(c, k, 5, stride=2, padding=1), nn.ReLU(),
                             nn.Conv1d(k, k, 5, stride=2, padding=1), nn.ReLU(),
                             nn.Conv1d(k, k, 5, stride=2, padding=1), nn.ReLU(),
                             nn.Flatten(), nn.Linear(k * n, classes))
    if kind == "cnn":
        (c, h, w), k = in_shape, width or 16
        return nn.Sequential(nn.Conv2d(c, k, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(k, 2 * k, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Flatten(), nn.Linear(2 * k * (h // 4) * (w // 4), classes))
    raise SpecError(f"workload.model={kind!r}: use mlp or cnn")


def _split(x: torch.Tensor, y: torch.Tensor, seed: int, test_fraction: float = 0.2):
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(x) * test_fraction)
    test, train = perm[:n_test], perm[n_test:]
    return x[train], y[train], x[test], y[test]


def _cached(name: str, make) -> dict[str, np.ndarray]:
    """The arrays `make()` returns, kept in TRIMLAB_CACHE/name after the first call."""
    from trimlab import native
    cache = native.cache_dir() / name
    if not cache.exists():
        arrays = make()
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_name(f"{cache.stem}.{os.getpid()}.tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(cache)  # a reader never sees half a file
    with np.load(cache) as z:
        return {k: z[k] for k in z.files}


def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits as it ships them (1 797 images of 8 × 8 values 0..16, float64;
    their labels), cached: importing scikit-learn costs a process as much as importing torch."""
    def make():
        from sklearn.datasets import load_digits  # heavy (scipy): only the first time
        d = load_digits()
        return {"data": d.data, "target": d.target}
    z = _cached("digits.npz", make)
    return z["data"], z["target"]


def _digits(seed: int):
    data, target = digits()
    x = torch.tensor(data, dtype=torch.float32).reshape(-1, *IMAGE) / 16.0
    return _split(x, torch.tensor(target, dtype=torch.int64), seed)


def _synthetic(seed: int, n: int = 4096, classes: int = 10):
    g = torch.Generator().manual_seed(_mix(seed, "teacher"))
    x = torch.randn(n, *IMAGE, generator=g)
    w1 = torch.randn(64, 64, generator=g) / 8
    w2 = torch.randn(64, classes, generator=g) / 8
    y = (torch.relu(x.reshape(n, -1) @ w1) @ w2).argmax(1)
    return _split(x, y, seed)


def _mnist1d(seed: int, samples: int = 10_000):
    """MNIST-1D as its package generates it (its own seed and split: the same data for every
    run), cached in TRIMLAB_CACHE: generating takes a few seconds."""
    def make():
        import random  # the generator seeds the global RNGs: keep them as they were

        from mnist1d.data import get_dataset_args, make_dataset  # heavy (scipy): only here
        state, pystate = np.random.get_state(), random.getstate()
        args = get_dataset_args()
        args.num_samples = samples
        d = make_dataset(args)
        np.random.set_state(state)
        random.setstate(pystate)
        return {k: d[k] for k in ("x", "y", "x_test", "y_test")}
    z = _cached(f"mnist1d-{samples}.npz", make)
    x, y, xt, yt = (torch.from_numpy(z[k]) for k in ("x", "y", "x_test", "y_test"))
    return x.float()[:, None, :], y.long(), xt.float()[:, None, :], yt.long()


def _cifar(kind: str, dataset: str | None):
    """CIFAR-10/100 from a directory in torchvision's layout (or its parent)."""
    import pickle
    sub, train, test, label = ({"cifar10": ("cifar-10-batches-py", [f"data_batch_{i}" for i in range(1, 6)],
                                            ["test_batch"], b"labels"),
                                "cifar100": ("cifar-100-python", ["train"], ["test"], b"fine_labels")}[kind])
    root = Path(dataset or "")
    root = root / sub if (root / sub).is_dir() else root
    missing = [n for n in train + test if not (root / n).is_file()]
    if not dataset or missing:
        raise SpecError(f"workload.dataset={dataset!r}: no {sub}/{missing[0] if missing else train[0]} there; "
                        f"give the directory holding torchvision's {sub}/ (its pickled batches)")

    def load(names):
        xs, ys = [], []
        for n in names:
            with open(root / n, "rb") as f:
                d = pickle.load(f, encoding="bytes")
            xs.append(np.asarray(d[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
            ys.append(np.asarray(d[label], dtype=np.int64))
        return torch.from_numpy(np.concatenate(xs)).float() / 255.0, torch.from_numpy(np.concatenate(ys))

    return (*load(train), *load(test))


def _custom(factory: str, dataset: str):
    mod_name, _, fn_name = factory.partition(":")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as exc:
        raise SpecError(f"workload.factory={factory!r}: cannot import it ({exc})") from None
    path = Path(dataset)
    if not path.exists():
        raise SpecError(f"workload.dataset={dataset!r}: no such file")
    if path.suffix == ".npz":
        with np.load(path) as z:
            data = {k: torch.from_numpy(z[k]) for k in z.files}
    else:
        data = torch.load(path, weights_only=True)
    keys = ("x_train", "y_train", "x_test", "y_test")
    missing = [k for k in keys if k not in data]
    if missing:
        raise SpecError(f"workload.dataset={dataset!r}: missing {', '.join(missing)} "
                        f"(a dataset holds {', '.join(keys)})")
    xs = [data[k].float() if k.startswith("x") else data[k].long() for k in keys]
    return fn(), xs


def build(workload: WorkloadConfig, seed: int) -> Workload:
    """The workload of a spec's `workload` section; the model initialised from `seed`."""
    if workload.kind == "custom":
        model, (xtr, ytr, xte, yte) = _custom(workload.factory, workload.dataset)
    else:
        if workload.kind in ("cifar10", "cifar100"):
            xtr, ytr, xte, yte = _cifar(workload.kind, workload.dataset)
        else:
            xtr, ytr, xte, yte = {"digits": _digits, "synthetic": _synthetic, "mnist1d": _mnist1d}[workload.kind](seed)
        torch.manual_seed(_mix(seed, "init"))
        model = make_model(workload.model, tuple(xtr.shape[1:]), 100 if workload.kind == "cifar100" else 10,
                           workload.width)
    if not isinstance(model, nn.Module):
        raise SpecError(f"workload.factory: returned {type(model).__name__}, not a torch.nn.Module")
    return Workload(model, xtr, ytr, xte, yte)


# -- the flat parameter vector ---------------------------------------------------------------

def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def set_flat_params(model: nn.Module, flat: torch.Tensor) -> None:
    i = 0
    with torch.no_grad():
        for p in model.parameters():
            n = p.numel()
            p.copy_(flat[i:i + n].view_as(p))
            i += n


def flat_grad(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                      for p in model.parameters()])


def checksum(flat: torch.Tensor) -> str:
    """Identity of a parameter vector, bit for bit."""
    return hashlib.sha256(flat.detach().to(torch.float32).contiguous().numpy().tobytes()).hexdigest()[:16]


class FlatSGD:
    """SGD (with optional momentum) on a slice of the flat parameter vector: the ps or a
    shard owner steps exactly the coordinates it owns."""

    def __init__(self, lr: float, momentum: float = 0.0):
        self.lr, self.momentum = lr, momentum
        self.buf: torch.Tensor | None = None

    def step(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        if self.momentum:
            self.buf = grad.clone() if self.buf is None else self.buf.mul_(self.momentum).add_(grad)
            grad = self.buf
        params.sub_(grad, alpha=self.lr)
