"""A training script written the way the README shows resuming: a checkpoint directory, the
data container's position saved with it, no bookkeeping by hand (run under du-launch).

    python tests/programs/resume.py OUT CHECKPOINTS [--epochs E] [--items DIR]
                                    [--die-at STEP] [--fault ATTEMPT:STEP:RANK:KIND ...] [--cut CMD]
                                    [--shard]

Rank 0 writes the final parameters to OUT (safetensors); every rank prints a digest of its own.
A fault happens to RANK at STEP of attempt ATTEMPT (DU_RESTART); the rank first prints it and
appends it to OUT.faults. KIND is kill (SIGKILL, as a crash), stop (SIGSTOP, as a frozen
machine), raise (an exception), exit0 (the program ends early, exit code 0) or cut (runs CMD,
which cuts the network link, then waits in the next step). ``--die-at S`` is
``--fault 0:S:1:kill``. du-launch --max-restarts then starts the job again, and it resumes
from the newest checkpoint. --items: each rank writes the items of every step to
DIR/rank-R.txt, as lines "STEP EPOCH ITEM...". --shard: the optimizer state is sharded.
--diloco H: DiLoCo syncing every H steps instead of DistributedOptimizer. --preempt: after
every step, ``du.preempted``: when True, save a checkpoint at that step and exit 0 (KIND
sigterm sends SIGTERM to RANK itself); --hold-at STEP: every rank waits at STEP, in
``du.preempted`` collectives, until a signal preempts the job.
"""

import argparse
import hashlib
import os
import signal
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du

p = argparse.ArgumentParser()
p.add_argument("out")
p.add_argument("checkpoints")
p.add_argument("--epochs", type=int, default=3)
p.add_argument("--items")
p.add_argument("--die-at", type=int)
p.add_argument("--fault", action="append", default=[])
p.add_argument("--cut")
p.add_argument("--shard", action="store_true")
p.add_argument("--diloco", type=int)
p.add_argument("--preempt", action="store_true")
p.add_argument("--hold-at", type=int)
args = p.parse_args()
faults = [f.split(":") for f in args.fault] + ([["0", str(args.die_at), "1", "kill"]] if args.die_at else [])
faults = {(int(a), int(s), int(r)): kind for a, s, r, kind in faults}


def fault(kind):
    # Recorded in OUT.faults too: over mpi, a remote rank's last line of output can die with the link it cuts.
    with open(f"{args.out}.faults", "a") as f:
        print(f"[rank {du.local_rank(backend)}] fault: {kind} at step {step}", file=f)
    print(f"fault: {kind} at step {step}", flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "raise":
        raise RuntimeError(f"an injected fault at step {step}")
    elif kind == "exit0":
        sys.exit(0)
    elif kind == "sigterm":
        os.kill(os.getpid(), signal.SIGTERM)
    elif kind == "cut":
        subprocess.run(args.cut, shell=True, check=True)
    else:
        raise ValueError(f"unknown fault {kind!r}")


backend = du.initialize()
rng = np.random.default_rng(0)
X = rng.standard_normal((90, 8)).astype(np.float32)
Y = np.tanh(X @ rng.standard_normal((8, 1))).astype(np.float32)
data = du.DistributedDataContainer(backend, (X, Y, np.arange(len(X))))

mx.random.seed(1)
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
opt = (
    du.DistributedOptimizer(backend, optim.Adam(1e-2), shard_optimizer_state=args.shard)
    if args.diloco is None
    else du.DiLoCo(backend, optim.Adam(1e-2), sync_every=args.diloco)
)
du.synchronize(backend, model)
loss_and_grad = nn.value_and_grad(model, lambda m, x, y: ((m(x) - y) ** 2).mean())

state = du.load_checkpoint(backend, args.checkpoints, model=model, optimizer=opt, data=data)
step = 0 if state is None else state["step"]
if state is not None:
    print(f"resumed at step {step}, epoch {data.epoch}, saved by {state['world_size']} ranks", flush=True)
for epoch in range(data.epoch, args.epochs):
    for x, y, items in data.batches(4, shuffle=True, seed=0, epoch=epoch):
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        step += 1
        if args.items:
            with open(os.path.join(args.items, f"rank-{du.local_rank(backend)}.txt"), "a") as f:
                print(step, epoch, *items.tolist(), file=f)
        kind = faults.get((int(os.environ.get("DU_RESTART", 0)), step, du.local_rank(backend)))
        if kind:
            fault(kind)
        if step == args.hold_at:
            print(f"holding at step {step}", flush=True)
            while not du.preempted(backend):
                pass
        if args.preempt and du.preempted(backend):
            du.save_checkpoint(
                backend, args.checkpoints, model=model, optimizer=opt, data=data, step=step, keep=2
            )
            print(f"preempted at step {step}: saved", flush=True)
            sys.exit(0)
        if step % 5 == 0:
            du.save_checkpoint(
                backend, args.checkpoints, model=model, optimizer=opt, data=data, step=step, keep=2
            )

print(
    f"parameters {hashlib.sha256(b''.join(np.array(p).tobytes() for _, p in tree_flatten(model.parameters()))).hexdigest()[:16]}"
)
if du.local_rank(backend) == 0:
    mx.save_safetensors(args.out, dict(tree_flatten(model.parameters())))
    print(f"done at step {step}; checkpoints kept: {sorted(os.listdir(args.checkpoints))}", flush=True)
