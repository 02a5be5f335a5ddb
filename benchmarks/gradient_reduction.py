"""Averaging a language model's gradients across ranks, four ways, side by side.

    python -m distributed_utils.launch -n 2 --backend mpi python benchmarks/gradient_reduction.py
    (also --backend ring and --backend mlx-mpi; options: --reps 10 --warmup 3 --extra
    --plot docs/images/gradient_reduction.png: each backend's run adds its bars to the picture)

The gradient tree has the parameter shapes of a small Llama (4 layers, dim 256, MLP 512, 4 heads,
vocabulary 50257 with an untied LM head: 28.4M float32 values, 113 MB in 39 arrays), random and
different on every rank. Timed, each one evaluated to the end, median of --reps runs after
--warmup (the methods take turns, so background load hits them alike; a barrier precedes each run):

  (a) per-leaf      one collective per array: mx.distributed.all_sum (MLX backends) or
                    du.allreduce(backend, g, "sum") (MPIBackend); a sum, not yet divided by N
  (b) average_grads mlx.nn.average_gradients(grads, group=...): MLX's bucketed concatenate /
                    all_sum / split. MPIBackend has no mx group, so (b) runs on MLX's own MPI
                    backend, started in the same processes (du.MLXMPIBackend): the same Open MPI
  (c) DistributedOptimizer(backend, SGD).reduce_gradients(grads), default options. With
                    MPIBackend it overwrites grads in place (same bytes every run). Its first
                    call raises MLX's cache limit, which (a), (b) and (d) then enjoy as well
  (d) lower bound   one all-reduce of one flat buffer of the same bytes, sum: MPI's in-place
                    Allreduce on a numpy buffer; all_sum of one flat mx.array

busbw follows nccl-tests: algbw = bytes / median time, busbw = algbw * 2 (n - 1) / n. The ratios
are of medians, and in parentheses the median of the per-run ratios (robust to load drift).
--extra adds rows for (c) with other bucket sizes, with op="sum" and with compression, and for
MPIBackend (d) on the memory of an mx.array (numpy's large buffers get transparent huge pages,
MLX's do not, and Open MPI copies them at about half the speed).
"""

import argparse
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du


def llama_gradients(rank, layers=4, dim=256, mlp=512, vocab=50257):
    """A gradient tree shaped like a small Llama's parameters (mlx-lm's names), rank-dependent."""
    key = mx.random.key(rank)

    def g(*shape):
        nonlocal key
        key, sub = mx.random.split(key)
        return mx.random.normal(shape, key=sub)

    layer = lambda: {  # noqa: E731
        "self_attn": {p: {"weight": g(dim, dim)} for p in ("q_proj", "k_proj", "v_proj", "o_proj")},
        "mlp": {
            "gate_proj": {"weight": g(mlp, dim)},
            "up_proj": {"weight": g(mlp, dim)},
            "down_proj": {"weight": g(dim, mlp)},
        },
        "input_layernorm": {"weight": g(dim)},
        "post_attention_layernorm": {"weight": g(dim)},
    }
    tree = {
        "model": {
            "embed_tokens": {"weight": g(vocab, dim)},
            "layers": [layer() for _ in range(layers)],
            "norm": {"weight": g(dim)},
        },
        "lm_head": {"weight": g(vocab, dim)},
    }
    mx.eval(tree)
    return tree


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--extra", action="store_true", help="also (c) with other bucket sizes and compression"
    )
    parser.add_argument("--plot", help="a PNG: each backend's times as multiples of (d)'s, and busbw")
    args = parser.parse_args()

    backend = du.initialize()
    n, rank = du.total_workers(backend), du.local_rank(backend)
    mlx_backend = backend if isinstance(backend, du.MLXBackend) else du.initialize(du.MLXMPIBackend)
    group = mlx_backend.group
    grads = llama_gradients(rank)
    leaves = [a for _, a in tree_flatten(grads)]
    nbytes = sum(a.nbytes for a in leaves)

    if isinstance(backend, du.MPIBackend):
        from mpi4py import MPI

        flat = np.random.default_rng(rank).standard_normal(nbytes // 4).astype(np.float32)
        per_leaf = lambda: [du.allreduce(backend, a, "sum") for a in leaves]  # noqa: E731
        lower_bound = lambda: backend.comm.Allreduce(MPI.IN_PLACE, flat)  # noqa: E731
    else:
        flat = mx.random.normal((nbytes // 4,), key=mx.random.key(rank))
        mx.eval(flat)
        per_leaf = lambda: [mx.distributed.all_sum(a, group=group) for a in leaves]  # noqa: E731
        lower_bound = lambda: mx.distributed.all_sum(flat, group=group)  # noqa: E731

    opt = du.DistributedOptimizer(backend, optim.SGD(0.1))
    methods = {
        "(a) per-leaf all_sum": per_leaf,
        "(b) nn.average_gradients": lambda: nn.average_gradients(grads, group=group),
        "(c) DistributedOptimizer": lambda: opt.reduce_gradients(grads),
        "(d) one flat all-reduce": lower_bound,
    }
    if args.extra and isinstance(backend, du.MPIBackend):  # numpy asks for huge pages, MLX does not
        mlx_flat = mx.random.normal((nbytes // 4,), key=mx.random.key(rank))
        mx.eval(mlx_flat)
        methods["(d) on an mx.array's memory"] = lambda: backend.comm.Allreduce(
            MPI.IN_PLACE, np.asarray(mlx_flat)
        )
    if args.extra:
        for label, kw in [
            ("bucket_bytes=0", {"bucket_bytes": 0}),
            ("bucket_bytes=1MiB", {"bucket_bytes": 2**20}),
            ("bucket_bytes=8MiB", {"bucket_bytes": 2**23}),
            ("bucket_bytes=32MiB", {"bucket_bytes": 2**25}),
            ("bucket_bytes=64MiB", {"bucket_bytes": 2**26}),
            ("bucket_bytes=1GiB", {"bucket_bytes": 2**30}),
            ("op=sum", {"op": "sum"}),
            ("compression=float16", {"compression": mx.float16}),
            ("compression=bfloat16", {"compression": mx.bfloat16}),
        ]:
            variant = du.DistributedOptimizer(backend, optim.SGD(0.1), **kw)
            methods[f"(c) {label}"] = (lambda o: lambda: o.reduce_gradients(grads))(variant)

    times = {name: [] for name in methods}
    names = list(methods)
    for rep in range(args.warmup + args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:  # each goes first in turn
            run = methods[name]
            du.barrier(backend)
            start = time.perf_counter()
            result = run()
            if result is not None:
                mx.eval(result)
            if rep >= args.warmup:
                times[name].append(time.perf_counter() - start)

    # a run's time is its slowest rank's
    times = {name: np.asarray(du.allreduce(backend, np.array(t), "max")) for name, t in times.items()}
    med = {name: float(np.median(t)) for name, t in times.items()}
    if rank != 0:
        return
    cache_limit = mx.set_cache_limit(0)
    mx.set_cache_limit(cache_limit)
    print(
        f"{type(backend).__name__}, {n} processes, {len(leaves)} arrays, {nbytes / 1e6:.1f} MB float32, "
        f"median of {args.reps} after {args.warmup} warmup (slowest rank); MLX cache limit now "
        f"{cache_limit / 2**20:.0f} MiB"
    )
    print(f"{'method':30s} {'median ms':>10s} {'min ms':>8s} {'algbw GB/s':>11s} {'busbw GB/s':>11s}")
    for name, t in med.items():
        algbw = nbytes / t / 1e9
        print(
            f"{name:30s} {t * 1e3:10.2f} {times[name].min() * 1e3:8.2f} {algbw:11.2f} {algbw * 2 * (n - 1) / n:11.2f}"
        )
    a, b, c, d = names[:4]
    ratio = lambda x, y: f"{med[x] / med[y]:.3f} (per run: {np.median(times[x] / times[y]):.3f})"  # noqa: E731
    print(f"c/d = {ratio(c, d)}   c/b = {ratio(c, b)}   a/c = {ratio(a, c)}")
    if args.plot:
        plot(args.plot, f"{type(backend).__name__} {n}", {name: med[name] for name in names[:4]}, nbytes, n)


def plot(path, key, medians: dict, nbytes, n):
    """Add this run's four methods to the picture at ``path``: time / (d)'s, and busbw."""
    import plots

    results = plots.remembered(path, key, medians)
    methods = list(medians)
    over_d = {run: [t[m] / t[methods[3]] for m in methods] for run, t in results.items()}
    busbw = {run: [nbytes / t[m] / 1e9 * 2 * (n - 1) / n for m in methods] for run, t in results.items()}
    labels = [m.replace(") ", ")\n", 1) for m in methods]
    panels = [("time / (d)'s (lower is better)", labels, over_d), ("busbw GB/s", labels, busbw)]
    plots.bars(path, f"Averaging a small Llama's gradients ({nbytes / 1e6:.0f} MB), median of runs", panels)


if __name__ == "__main__":
    main()
