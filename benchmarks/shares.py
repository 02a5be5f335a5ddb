"""Unequal hosts: equal batches against ``batches(share="auto")``, samples per second side by side.

    python -m distributed_utils.launch -n 3 --backend ring python benchmarks/shares.py [--epochs 3]

Each rank pins itself (every thread) to one core, as ``taskset`` does: rank 0 alone on core 0, the others
together on core 1, so rank 0 works about twice as fast as each of them (on this 2-core
machine). The model: an MLP of 3 x 1024 (3.1M parameters), batch 64 per rank on average
(global 192), AdamW, the gradients weighted by each rank's batch. The two ways take turns,
one epoch each; rank 0 prints samples per second of each epoch and the ratio of the medians.
"""

import argparse
import os
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

import distributed_utils as du


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3, help="epochs of each way")
    p.add_argument("--items", type=int, default=192 * 40)
    args = p.parse_args()
    backend = du.initialize()
    rank = du.local_rank(backend)
    for thread in os.listdir("/proc/self/task"):  # every thread: MLX's own were started at import
        try:
            os.sched_setaffinity(int(thread), {0 if rank == 0 else 1 % os.cpu_count()})
        except ProcessLookupError:  # a thread that has ended since
            pass
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.items, 256)).astype(np.float32)
    y = np.tanh(x[:, :16]).astype(np.float32)
    data = du.DistributedDataContainer(backend, (x, y))
    mx.random.seed(0)
    model = nn.Sequential(
        nn.Linear(256, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 1024),
        nn.ReLU(),
        nn.Linear(1024, 16),
    )
    du.synchronize(backend, model)
    opt = du.DistributedOptimizer(backend, optim.AdamW(1e-3))
    loss_and_grad = nn.value_and_grad(model, lambda m, a, b: nn.losses.mse_loss(m(a), b))
    rates = {"equal": [], "auto": []}
    for epoch in range(2 * args.epochs):
        way = "equal" if epoch % 2 == 0 else "auto"
        du.barrier(backend)
        start, items = time.perf_counter(), 0
        for bx, by in data.batches(64, shuffle=True, epoch=epoch, share=None if way == "equal" else "auto"):
            _, grads = loss_and_grad(model, bx, by)
            opt.update(model, grads, weight=len(bx))
            mx.eval(model.parameters(), opt.state)
            items += len(bx)
        total = du.allreduce(backend, items, "sum")
        rates[way].append(total / du.allreduce(backend, time.perf_counter() - start, "max"))
        if rank == 0:
            print(f"epoch {epoch} ({way}): {rates[way][-1]:.0f} samples/s", flush=True)
    if rank == 0:
        equal, auto = (statistics.median(rates[k]) for k in ("equal", "auto"))
        print(f"equal batches {equal:.0f} samples/s, share='auto' {auto:.0f} samples/s: {auto / equal:.2f}x")


if __name__ == "__main__":
    main()
