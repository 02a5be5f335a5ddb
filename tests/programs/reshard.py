"""A fully sharded model saved at one world size and loaded at another (tests/test_resharding.py).

    du-launch -n N ... python tests/programs/reshard.py CHECKPOINT [--load FROM] [--steps K]

Builds tests/distributed/test_fsdp.py's Net (blocks and root fully sharded), loads FROM if given,
trains K steps on a fixed global batch of 12 rows split over the ranks, saves CHECKPOINT, and rank
0 prints the digest of the whole parameters and optimizer state after the load and at the end.
"""

import argparse
import hashlib
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "distributed"))
from test_fsdp import Net, loss_fn  # noqa: E402

import distributed_utils as du  # noqa: E402
from distributed_utils import fsdp  # noqa: E402


def digest(backend, model, opt) -> str:
    shards = fsdp.sharded(model)
    trees = [fsdp.whole_tree(model.parameters(), shards), fsdp.whole_tree(opt.state, shards)]
    h = hashlib.sha256()
    for tree in trees:
        for key, a in tree_flatten(tree):
            h.update(key.encode() + np.asarray(a.astype(mx.float32)).tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("--load")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    backend = du.initialize()
    mx.random.seed(1 + backend.rank)  # other values everywhere: fully_shard takes rank 0's
    model = Net()
    for block in model.blocks:
        du.fully_shard(backend, block)
    du.fully_shard(backend, model)
    opt = du.DistributedOptimizer(backend, optim.Adam(1e-2))
    if args.load:
        du.load_checkpoint(backend, args.load, model=model, optimizer=opt)
        loaded = digest(backend, model, opt)
        if backend.rank == 0:
            print(f"loaded {loaded}", flush=True)
    rows = 12 // backend.size
    step = nn.value_and_grad(model, loss_fn)
    for s in range(args.steps):
        mx.random.seed(100 + s)
        x, y = mx.random.normal((12, 3)), mx.random.normal((12, 2))
        mine = slice(backend.rank * rows, (backend.rank + 1) * rows)
        _, grads = step(model, x[mine], y[mine])
        opt.update(model, grads)
        mx.eval(model.parameters(), opt.state)
    du.save_checkpoint(backend, args.checkpoint, model=model, optimizer=opt, step=args.steps)
    saved = digest(backend, model, opt)
    if backend.rank == 0:
        print(f"saved {saved}", flush=True)


if __name__ == "__main__":
    main()
