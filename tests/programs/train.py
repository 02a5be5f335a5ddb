"""A small data-parallel training run for the reliability tests (run under du-launch).

    python tests/programs/train.py OUT [--steps N] [--checkpoint PATH --every K] [--say-at S] [--diloco H]

Trains an MLP with dropout (so the random state matters) on a fixed synthetic data set,
shuffled per epoch; rank 0 writes the final parameters to OUT (safetensors). With
--checkpoint it resumes from PATH when it exists and saves there every K steps.
--say-at prints "at step S" once and goes on (a signal for a test to act mid-run); --log
copies each rank's stderr to LOG-RANK.log (its reports, even when its output cannot reach
the launcher). --diloco H: DiLoCo syncing every H steps instead of DistributedOptimizer.
Every rank prints a digest of its final parameters.
"""

import argparse
import hashlib
import os
import socket
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("--steps", type=int, default=12)
p.add_argument("--checkpoint")
p.add_argument("--every", type=int, default=4)
p.add_argument("--say-at", type=int)
p.add_argument("--log")
p.add_argument("--diloco", type=int)
args = p.parse_args()

backend = du.initialize()
rank = du.local_rank(backend)


def crash_halfway_through_save(n):
    """Die (exit 99) halfway through writing the n-th checkpoint's first array, as a killed job would."""
    files, write = [], du.checkpoint._write_pieces

    def dying(f, data, heartbeat):
        if f not in files:  # (a save's file)
            files.append(f)
        if len(files) == n:
            f.write(memoryview(data).cast("B")[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            os._exit(99)
        write(f, data, heartbeat)

    du.checkpoint._write_pieces = dying


if os.environ.get("DU_TEST_CRASH_IN_CHECKPOINT"):
    crash_halfway_through_save(int(os.environ["DU_TEST_CRASH_IN_CHECKPOINT"]))


class Tee:
    def __init__(self, *streams):
        self.streams = streams

    def write(self, text):
        for s in self.streams:
            s.write(text)
            s.flush()

    def flush(self):
        pass


if args.log:
    sys.stderr = Tee(sys.stderr, open(f"{args.log}-{rank}.log", "a"))
rng = np.random.default_rng(0)
X = rng.standard_normal((96, 8)).astype(np.float32)
Y = np.tanh(X @ rng.standard_normal((8, 1))).astype(np.float32)
data = du.DistributedDataContainer(backend, (X, Y))
BATCH = 4
per_epoch = data.num_batches(BATCH)

mx.random.seed(1)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
opt = (
    du.DistributedOptimizer(backend, optim.Adam(1e-2))
    if args.diloco is None
    else du.DiLoCo(backend, optim.Adam(1e-2), sync_every=args.diloco)
)
du.synchronize(backend, model)
loss_and_grad = nn.value_and_grad(model, lambda m, x, y: ((m(x) - y) ** 2).mean())

step = 0
if args.checkpoint:
    state = du.load_checkpoint(backend, args.checkpoint, model=model, optimizer=opt)
    if state is not None:
        step = state["step"]
        assert state["data"] == {"epoch": step // per_epoch, "batch": step % per_epoch}, state
        print(f"resumed at step {step}", flush=True)

while step < args.steps:
    epoch, start = divmod(step, per_epoch)
    for x, y in data.batches(BATCH, shuffle=True, seed=0, epoch=epoch, start=start):
        with du.watch("train step"):
            loss, grads = loss_and_grad(model, x, y)
            opt.update(model, grads)
            mx.eval(loss, model.parameters(), opt.state)
        step += 1
        if step == args.say_at:
            print(f"at step {step}", flush=True)
        if args.checkpoint and step % args.every == 0:
            position = {"epoch": step // per_epoch, "batch": step % per_epoch}
            du.save_checkpoint(backend, args.checkpoint, model=model, optimizer=opt, data=position, step=step)
            print(f"saved step {step}", flush=True)
        if step == args.steps:
            break

if rank == 0:
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
digest = hashlib.sha256(
    b"".join(np.array(p).tobytes() for _, p in tree_flatten(model.parameters()))
).hexdigest()
print(f"done at step {step} on {socket.gethostname()}, parameters {digest[:16]}", flush=True)
