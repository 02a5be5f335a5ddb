"""A training script written the way the README shows resuming: a checkpoint directory, the
data container's position saved with it, no bookkeeping by hand (run under du-launch).

    python tests/programs/resume.py OUT CHECKPOINTS [--die-at STEP]

Rank 0 writes the final parameters to OUT (safetensors). --die-at kills rank 1 (SIGKILL) at
that step of the first attempt (DU_RESTART=0), as a crash would; du-launch --max-restarts
then starts the job again, and it resumes from the newest checkpoint.
"""

import argparse
import os
import signal

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("checkpoints")
p.add_argument("--die-at", type=int)
args = p.parse_args()

backend = du.initialize()
rng = np.random.default_rng(0)
X = rng.standard_normal((90, 8)).astype(np.float32)
Y = np.tanh(X @ rng.standard_normal((8, 1))).astype(np.float32)
data = du.DistributedDataContainer(backend, (X, Y))

mx.random.seed(1)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
opt = du.DistributedOptimizer(backend, optim.Adam(1e-2))
du.synchronize(backend, model)
loss_and_grad = nn.value_and_grad(model, lambda m, x, y: ((m(x) - y) ** 2).mean())

state = du.load_checkpoint(backend, args.checkpoints, model=model, optimizer=opt, data=data)
step = 0 if state is None else state["step"]
if state is not None:
    print(f"resumed at step {step}, epoch {data.epoch}", flush=True)
for epoch in range(data.epoch, 3):
    for x, y in data.batches(4, shuffle=True, seed=0, epoch=epoch):
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        step += 1
        if step == args.die_at and du.local_rank(backend) == 1 and os.environ.get("DU_RESTART") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        if step % 5 == 0:
            du.save_checkpoint(backend, args.checkpoints, model=model, optimizer=opt, data=data, step=step, keep=2)

if du.local_rank(backend) == 0:
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    print(f"done at step {step}; checkpoints kept: {sorted(os.listdir(args.checkpoints))}", flush=True)
