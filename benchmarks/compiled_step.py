"""A training step compiled (mlx-lm's idiom: the update inside ``mx.compile``) against the same
step uncompiled, side by side in one run.

    python -m distributed_utils.launch -n 2 --backend mpi python benchmarks/compiled_step.py
    (also --backend ring and mlx-mpi; options: --reps 20 --warmup 3 --width 1024 --batch 64)

The model: an MLP of 4 layers of --width (4.2M float32 parameters at 1024) with GELU, trained
with AdamW through ``du.DistributedOptimizer`` on random data, different on every rank. Both
versions start from the same parameters and take turns (a barrier before each step), so
background load hits them alike; timed to the end of ``mx.eval``; the slowest rank's median.
On MPIBackend the compiled step's collectives are MLX's own MPI ops (traced), the uncompiled
step's are mpi4py's, in place.
"""

import argparse
import time
from functools import partial

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du


def mlp(width, seed=0):
    mx.random.seed(seed)
    layers = []
    for _ in range(3):
        layers += [nn.Linear(width, width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    mx.eval(model.parameters())
    return model


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()

    backend = du.initialize()
    rank = du.local_rank(backend)
    mx.random.seed(100 + rank)
    x, y = mx.random.normal((args.batch, args.width)), mx.random.randint(0, 10, (args.batch,))

    steps = {}
    for name in ("uncompiled", "compiled"):
        model, opt = mlp(args.width), du.DistributedOptimizer(backend, optim.AdamW(1e-4))
        opt.init(model.trainable_parameters())
        loss_and_grad = nn.value_and_grad(model, loss_fn)

        def step(x, y, model=model, opt=opt, loss_and_grad=loss_and_grad):
            loss, grads = loss_and_grad(model, x, y)
            opt.update(model, grads)
            return loss

        state = [model.state, opt.state]
        steps[name] = (
            partial(mx.compile, inputs=state, outputs=state)(step) if name == "compiled" else step,
            state,
        )

    times = {name: [] for name in steps}
    for rep in range(args.warmup + args.reps):
        for name, (step, state) in steps.items():
            du.barrier(backend)
            start = time.perf_counter()
            with du.watch(f"{name} step"):
                mx.eval(step(x, y), state)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - start)

    medians = du.allreduce(backend, np.array([np.median(times[n]) for n in steps]), "max")
    if rank == 0:
        n_params = sum(v.size for _, v in tree_flatten(mlp(args.width).parameters()))
        print(
            f"{type(backend).__name__}, {du.total_workers(backend)} ranks, MLP of {n_params / 1e6:.1f}M parameters, "
            f"batch {args.batch} per rank; median of {args.reps} steps, slowest rank"
        )
        for name, t in zip(steps, medians):
            print(f"{name:<12}{t * 1e3:9.1f} ms")
        print(f"compiled/uncompiled: {medians[1] / medians[0]:.2f}")


if __name__ == "__main__":
    main()
