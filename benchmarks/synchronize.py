"""Time du.synchronize of a large parameter tree against one raw du.bcast of the same bytes.

    python -m distributed_utils.launch -n 2 --backend mpi python benchmarks/synchronize.py [--params 25e6] [--reps 5]

The tree is float32 matrices and vectors shaped like a transformer's blocks (d = 512), plus
bfloat16 and int64 leaves, about ``--params`` values in all. Rows, each the median over
``--reps`` runs of the slowest rank's time (every run starts after a barrier; rows take turns):

  bcast       one du.bcast of a pre-allocated flat float32 buffer of the tree's bytes: the floor
  synchronize du.synchronize(backend, tree): checks the structure, packs, one bcast per item size
  per leaf    for contrast: one du.bcast per leaf
"""

import argparse
import statistics
import time

import mlx.core as mx

import distributed_utils as du

D = 512  # one block: an MLP (D x 4D, 4D x D), attention (4 x D x D), their biases and a norm
SHAPES = [(D, 4 * D), (4 * D,), (4 * D, D), (D,), (D, D), (D, D), (D, D), (D, D), (D,)]


def make_tree(params: int, rank: int) -> dict:
    """Blocks of SHAPES until ``params`` values; rank 0's are random, the others' zeros."""
    blocks, total = [], 0
    while total < params:
        block = {f"p{i}": (mx.random.normal(s) if rank == 0 else mx.zeros(s)) for i, s in enumerate(SHAPES)}
        block["scale"] = mx.ones((D,), mx.bfloat16)
        blocks.append(block)
        total += sum(a.size for a in block.values())
    tree = {"blocks": blocks, "step": mx.array(rank, mx.int64), "name": f"rank {rank}"}
    mx.eval(tree["blocks"], tree["step"])
    return tree


def timed(backend, fns: dict, reps: int) -> dict:
    """Median over ``reps`` of the slowest rank's seconds for each of ``fns``, taken in turns so
    that a busy machine slows them alike."""
    times = {name: [] for name in fns}
    for rep in range(reps + 1):  # the first round warms up
        for name, fn in fns.items():
            du.barrier(backend)
            start = time.perf_counter()
            fn()
            seconds = max(du.allgather(backend, time.perf_counter() - start))
            if rep:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--params", type=float, default=25e6, help="values in the tree (default 25e6)")
    p.add_argument("--reps", type=int, default=5, help="timed runs per row (default 5)")
    args = p.parse_args()

    backend = du.initialize()
    rank, size = du.local_rank(backend), du.total_workers(backend)
    tree = make_tree(int(args.params), rank)
    leaves = [a for block in tree["blocks"] for a in block.values()] + [tree["step"]]
    nbytes = sum(a.nbytes for a in leaves)
    flat = mx.zeros((nbytes // 4,), mx.float32)
    mx.eval(flat)

    def sync():
        out = du.synchronize(backend, tree)
        mx.eval([a for block in out["blocks"] for a in block.values()])

    def per_leaf():
        for a in leaves:
            mx.eval(du.bcast(backend, a))

    fns = {"bcast": lambda: mx.eval(du.bcast(backend, flat)), "synchronize": sync, "per leaf": per_leaf}
    rows = timed(backend, fns, args.reps)
    if rank == 0:
        print(
            f"{size} ranks, {type(backend).__name__}: {sum(a.size for a in leaves) / 1e6:.1f}M values "
            f"in {len(leaves)} arrays, {nbytes / 2**20:.0f} MiB; median of {args.reps} runs\n"
        )
        print("| what | ms | GB/s | / bcast |\n| --- | ---: | ---: | ---: |")
        for name, seconds in rows.items():
            print(
                f"| {name} | {seconds * 1e3:.1f} | {nbytes / seconds / 1e9:.2f} | {seconds / rows['bcast']:.2f} |"
            )


if __name__ == "__main__":
    main()
