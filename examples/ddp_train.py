"""A plain torch DDP training script: an MLP on scikit-learn's digits (shipped with the
package, no download; trimlab keeps a copy that loads without importing scikit-learn), SGD
with momentum, gloo for rendezvous. It runs under torchrun or `trimlab run
experiments/ddp.yaml`, which sets torchrun's environment on every worker.
The one trimlab line is the comm hook; `--comm allreduce` runs DDP's own gloo all-reduce,
`--comm local` no gradient exchange at all (each rank steps on its own gradient: the
compute floor of a step on this host).
`--data mnist1d --model cnn` trains trimlab's MNIST-1D workload instead (the same data and
model for every contender); `--eval-every N` adds test accuracy to every Nth step line.

    torchrun --nproc-per-node 4 examples/ddp_train.py --steps 50
"""

import argparse
import gc
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--comm", choices=["trimlab", "allreduce", "local"], default="trimlab")
    ap.add_argument("--data", choices=["digits", "mnist1d"], default="digits",
                    help="mnist1d: trimlab's MNIST-1D workload (its data and model, the same for every contender)")
    ap.add_argument("--model", choices=["mlp", "cnn"], default="mlp")
    ap.add_argument("--eval-every", type=int, default=0, help="test accuracy every N steps (0: at the end only)")
    ap.add_argument("--time-limit", type=float, default=0.0,
                    help="seconds: stop at the first evaluation past this much training (every rank at the same step)")
    ap.add_argument("--width", type=int, help="units per hidden layer (digits' mlp: default 64), or the "
                    "mnist1d model's width (trimlab's workload.width)")
    ap.add_argument("--depth", type=int, default=1, help="hidden layers (2 × 1000 ≈ 1.1 M parameters)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="cuda: model and batches on the GPU (LOCAL_RANK's), DDP's buckets there too")
    ap.add_argument("--save", help="save the final parameters here ({rank} is replaced)")
    args = ap.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device here")
    digits = args.data == "digits" and args.model == "mlp"
    if digits:  # scikit-learn's digits, cached (its first load imports scipy: before gloo's threads)
        from trimlab.agents.workloads import digits as load_digits
        data, target = load_digits()
    dist.init_process_group("gloo")  # env://: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    rank = dist.get_rank()
    torch.manual_seed(args.seed)
    if digits:
        x, y = torch.tensor(data / 16.0, dtype=torch.float32), torch.tensor(target)
        perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(args.seed))
        cut = int(0.8 * len(x))
        (xtr, ytr), (xte, yte) = (x[perm[:cut]], y[perm[:cut]]), (x[perm[cut:]], y[perm[cut:]])
        sizes = [64] + [args.width or 64] * args.depth
        layers = [m for a, b in zip(sizes, sizes[1:]) for m in (nn.Linear(a, b), nn.ReLU())]
        model = nn.Sequential(*layers, nn.Linear(sizes[-1], 10))
    else:
        from trimlab.agents import workloads
        from trimlab.config import WorkloadConfig
        wl = workloads.build(WorkloadConfig(kind=args.data, model=args.model, width=args.width), args.seed)
        model, xtr, ytr, xte, yte = wl.model, wl.x_train, wl.y_train, wl.x_test, wl.y_test
    device = torch.device("cpu")
    if args.device == "cuda":  # ranks past the GPUs' count share them round-robin
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    model = model.to(device)
    xtr, ytr, xte, yte = xtr.to(device), ytr.to(device), xte.to(device), yte.to(device)
    ddp = DDP(model)
    if args.comm == "trimlab":
        from trimlab.agents.ddp_hook import (  # the baseline runs without trimlab
            TrimlabState,
            trimlab_hook,
        )
        ddp.register_comm_hook(TrimlabState.from_env(), trimlab_hook)
    elif args.comm == "local":
        def keep_local(_, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut
        ddp.register_comm_hook(None, keep_local)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)
    g = torch.Generator().manual_seed(1000 * args.seed + rank)  # each rank its own batches

    def accuracy() -> float:
        model.eval()
        with torch.no_grad():
            acc = float((model(xte).argmax(1) == yte).float().mean())
        model.train()
        return acc

    start, done, over = time.perf_counter(), 0, False
    for step in range(args.steps):
        t0, c0 = time.perf_counter(), time.process_time()
        idx = torch.randint(len(xtr), (args.batch,), generator=g).to(device)
        loss = nn.functional.cross_entropy(ddp(xtr[idx]), ytr[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        line = {"event": "step", "role": "worker", "rank": rank, "step": step, "loss": round(loss.item(), 5),
                "step_s": round(time.perf_counter() - t0, 5), "t": round(time.perf_counter() - start, 4),
                # the process's CPU in the step, every thread, user and system (the kernel's
                # work on its sends included): beside step_s, how busy this rank kept a core
                "cpu_s": round(time.process_time() - c0, 5)}
        if args.eval_every and (step % args.eval_every == args.eval_every - 1 or step == args.steps - 1):
            line["test_acc"] = round(accuracy(), 5)  # not timed: `t` was taken before
            if args.time_limit:  # the ranks' clocks differ: the first rank past the limit stops them all
                flag = torch.tensor([float(time.perf_counter() - start >= args.time_limit)])
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                over = bool(flag.item())
        say(line)
        done = step + 1
        if over:
            break
    acc = accuracy()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()
    say({"event": "done", "rank": rank, "test_acc": round(acc, 5), "steps": done, "time_limit": over,
         "checksum": hashlib.sha256(flat.numpy().tobytes()).hexdigest()[:16]})
    if args.save:
        torch.save(model.state_dict(), args.save.format(rank=rank))
    dist.barrier()  # no rank tears gloo down while a peer still talks to it
    # DDP's reducer holds the process group and gloo's last work (a reference cycle): free
    # them while the interpreter is whole, so that destroying the group joins gloo's threads
    # now; left to the interpreter's teardown, a gloo thread can abort the process (seen as
    # "terminate called without an active exception" after every step was done)
    del ddp, opt
    gc.collect()
    dist.destroy_process_group()


def say(event: dict) -> None:
    """One JSON line in one write: under torchrun the ranks share stdout."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
