"""Train a digits classifier data-parallel: the whole distributed_utils workflow in one file.

    du-launch -n 2 --backend mpi python examples/digits.py            # or --backend ring
    du-launch -n 2 --backend mpi python examples/digits.py --epochs 5 --checkpoint ckpt
    du-launch -n 2 --backend mpi python examples/digits.py --epochs 10 --checkpoint ckpt --resume

The data is scikit-learn's bundled 8x8 digits (1797 images, 10 classes; no download). Every
rank runs this same script: it trains on its own share of each epoch's batches, the
gradients are averaged across ranks before every update, so N ranks with batch B follow the
trajectory of one process with batch N*B. Rank 0 alone logs and writes checkpoints.
"""

import argparse
import hashlib
import os
import sys
import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten
from sklearn.datasets import load_digits
from tqdm import tqdm

import distributed_utils as du


class MLP(nn.Module):
    def __init__(self, n_in=64, hidden=128, n_out=10):
        super().__init__()
        self.layers = [nn.Linear(n_in, hidden), nn.Linear(hidden, hidden), nn.Linear(hidden, n_out)]

    def __call__(self, x):
        for layer in self.layers[:-1]:
            x = nn.relu(layer(x))
        return self.layers[-1](x)


def loss_fn(model, x, y):
    return nn.losses.cross_entropy(model(x), y, reduction="mean")


def load_split(seed=0, n_test=360):
    """The same fixed train/test split on every rank (a permutation from a fixed seed)."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)  # pixels 0..16 -> 0..1
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def evaluate(backend, model, test):
    """Loss and accuracy on the whole test set. Each rank scores its own shard (disjoint,
    together the whole set), then the sums and counts are all-reduced: every rank gets
    the global numbers, and ranks with shards of different sizes are weighed correctly."""
    x, y = (mx.array(np.stack(column)) for column in zip(*test))  # this rank's shard, one batch
    logits = model(x)
    local = mx.stack(
        [
            nn.losses.cross_entropy(logits, y, reduction="sum"),
            (logits.argmax(axis=-1) == y).sum().astype(mx.float32),
            mx.array(y.size, mx.float32),
        ]
    )
    loss_sum, correct, count = du.allreduce(backend, local, "sum").tolist()
    return loss_sum / count, correct / count


def checksum(model):
    """A short hash of every parameter's bytes: equal hashes mean bit-identical weights."""
    h = hashlib.sha256()
    for _, p in tree_flatten(model.parameters()):
        h.update(np.array(p).tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=10, help="total epochs (default: 10)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default: 32)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate (default: 1e-3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--checkpoint", metavar="DIR", help="rank 0 saves DIR/digits.safetensors after every epoch"
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the checkpoint in DIR, if there is one"
    )
    args = p.parse_args()
    if args.resume and not args.checkpoint:
        p.error("--resume needs --checkpoint DIR")

    # 1. Start the backend du-launch chose (--backend mpi|ring|mlx-mpi); a world of one without it.
    backend = du.initialize()
    rank, world = du.local_rank(backend), du.total_workers(backend)
    log = print if rank == 0 else lambda *a, **k: None  # rank 0 alone logs

    # 2. The model, and its optimizer wrapped so that gradients are averaged across ranks.
    mx.random.seed(args.seed + rank)  # different on purpose: synchronize gives everyone rank 0's
    model = MLP()
    opt = du.DistributedOptimizer(backend, optim.Adam(learning_rate=args.lr))
    du.synchronize(backend, model)  # every rank now holds rank 0's weights
    du.synchronize(backend, opt, model=model)  # and rank 0's optimizer state (created from model)

    # 3. The data: every rank loads the same arrays; the containers give each rank its share.
    (x_train, y_train), (x_test, y_test) = load_split(args.seed)
    train = du.DistributedDataContainer(backend, (x_train, y_train))
    test = du.DistributedDataContainer(backend, (x_test, y_test))

    # 4. Resume: rank 0 reads the checkpoint and broadcasts it (weights, optimizer state, epoch).
    path = os.path.join(args.checkpoint, "digits.safetensors") if args.checkpoint else None
    first_epoch = 0
    if args.resume:
        saved = du.load_checkpoint(backend, path, model=model, optimizer=opt)  # collective
        if saved is None:
            log(f"no checkpoint at {path} yet: starting from scratch")
        else:
            first_epoch = saved["data"]["epoch"]
            log(f"resumed from {path} at epoch {first_epoch + 1} (step {saved['step']})")

    steps = train.num_batches(args.batch_size)  # the same on every rank
    log(
        f"{type(backend).__name__}: {world} ranks, {len(x_train)} training images "
        f"({len(train)} on rank 0), {steps} steps of {world} x {args.batch_size} per epoch"
    )
    # 5. Train: the DESIGN.md loop, plus evaluation, logging and checkpoints after each epoch.
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    start = time.perf_counter()
    for epoch in range(first_epoch, args.epochs):
        # a progress bar on rank 0 only; it gives way to the epoch's summary line when done
        bar = tqdm(total=steps, desc=f"epoch {epoch + 1}", disable=rank != 0, leave=False, file=sys.stdout)
        losses = []
        # shuffled by (seed, epoch): one permutation shared by every rank, then sharded
        for x, y in train.batches(args.batch_size, shuffle=True, seed=args.seed, epoch=epoch):
            loss, grads = loss_and_grad(model, x, y)
            opt.update(model, grads)  # all-reduce (average) the gradients, then Adam
            mx.eval(loss, model.parameters(), opt.state)
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.3f}")
            bar.update()
        bar.close()

        # training loss averaged over ranks; test metrics over the whole test set
        train_loss = du.allreduce(backend, float(np.mean(losses)), "avg")
        test_loss, test_acc = evaluate(backend, model, test)
        log(
            f"epoch {epoch + 1:3d}  train loss {train_loss:.4f}  test loss {test_loss:.4f}  "
            f"test accuracy {test_acc:.4f}"
        )

        if path:  # collective (not under `if rank == 0`): rank 0 writes, the others wait for it
            du.save_checkpoint(
                backend, path, model=model, optimizer=opt, data={"epoch": epoch + 1}, step=(epoch + 1) * steps
            )

    test_loss, test_acc = evaluate(backend, model, test)
    log(
        f"final test loss {test_loss:.4f}  test accuracy {test_acc:.4f}  "
        f"({time.perf_counter() - start:.1f} s on {world} ranks)"
    )
    log(f"parameter checksum {checksum(model)}")


if __name__ == "__main__":
    main()
