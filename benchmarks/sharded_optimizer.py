"""Replicated against sharded optimizer state (ZeRO-1), side by side in one run: memory and
time of an AdamW step per rank.

    python -m distributed_utils.launch -n 2 --backend mpi python benchmarks/sharded_optimizer.py
    (also -n 4, --backend ring and mlx-mpi; options: --reps 10 --warmup 2)

The parameters and gradients have the shapes of the small Llama of gradient_reduction.py
(28.4M float32 values, 113 MB); the gradients are random and different on every rank. A step
is ``opt.apply_gradients(grads, params)`` evaluated to the end: the gradient reduction (an
all-reduce, or a reduce-scatter and an all-gather when sharded) and AdamW's update (of every
element, or of this rank's 1/N). The forward and backward passes, the same either way, are
left out: the ratios are those of the part that differs. The two optimizers take turns
(a barrier before each step), so background load hits them alike. Reported per method, the
largest over the ranks: the optimizer state's bytes, MLX's peak memory during a step above
what was allocated before it (the step's temporaries), the total (parameters, gradients,
state and the step's peak) and the median step time.
"""

import argparse
import time

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from gradient_reduction import llama_gradients
from mlx.utils import tree_flatten

import distributed_utils as du

METHODS = {"replicated": False, "sharded": True}


def state_bytes(opt) -> int:
    return sum(a.nbytes for _, a in tree_flatten(opt.state) if isinstance(a, mx.array))


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()

    backend = du.initialize()
    n, rank = du.total_workers(backend), du.local_rank(backend)
    grads = llama_gradients(rank)
    params = {name: llama_gradients(10**6) for name in METHODS}  # the same on every rank
    opts = {
        name: du.DistributedOptimizer(backend, optim.AdamW(1e-4), shard_optimizer_state=shard)
        for name, shard in METHODS.items()
    }
    times = {name: [] for name in METHODS}
    peaks = {name: 0 for name in METHODS}
    for rep in range(args.warmup + args.reps):
        for name, opt in opts.items():
            du.barrier(backend)
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            start = time.perf_counter()
            params[name] = opt.apply_gradients(grads, params[name])
            mx.eval(params[name], opt.state)
            elapsed = time.perf_counter() - start
            if rep >= args.warmup:
                times[name].append(elapsed)
                peaks[name] = max(peaks[name], mx.get_peak_memory() - before)
    same = all(
        mx.array_equal(a, b).item()
        for (_, a), (_, b) in zip(tree_flatten(params["replicated"]), tree_flatten(params["sharded"]))
    )

    resident = 2 * sum(a.nbytes for _, a in tree_flatten(grads))  # the parameters and the gradients
    mine = np.array(
        [
            [state_bytes(opts[m]), peaks[m], resident + state_bytes(opts[m]) + peaks[m], np.median(times[m])]
            for m in METHODS
        ],
        np.float64,
    )
    worst = du.allreduce(backend, mine, "max")  # the slowest, fullest rank
    if rank == 0:
        mib = 2**20
        print(
            f"{type(backend).__name__}, {n} ranks, AdamW on 28.4M float32 parameters; "
            f"parameters identical after {args.warmup + args.reps} steps: {same}"
        )
        print(f"{'method':<12}{'state MiB':>11}{'step peak MiB':>15}{'total MiB':>11}{'step ms':>9}")
        for name, (state, peak, total, t) in zip(METHODS, worst):
            print(f"{name:<12}{state / mib:>11.1f}{peak / mib:>15.1f}{total / mib:>11.1f}{t * 1e3:>9.1f}")
        (rs, rp, rtotal, rt), (ss, sp, stotal, st) = worst
        print(
            f"sharded/replicated: state {ss / rs:.3f} (1/N = {1 / n:.3f}), step peak {sp / rp:.2f}, "
            f"total {stotal / rtotal:.2f}, step time {st / rt:.2f}"
        )


if __name__ == "__main__":
    main()
