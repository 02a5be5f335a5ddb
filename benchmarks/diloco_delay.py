"""Does DiLoCo's fragment_sync_delay hide a sync behind the inner steps? Two hosts made of network
namespaces (tests/hosts.py), the link shaped with tc's token bucket filter. Needs root.

    python benchmarks/diloco_delay.py [--rate 100mbit] [--backends ring mpi] [--rounds 3]

One rank per host trains a model of two 1024 x 1024 layers (8.4 MB of float32, about the size
of one sync at 100 Mbit/s, 0.7 s, to its 8 inner steps' compute) with DiLoCo, sync_every 8:
without a delay (each sync waits for its all-reduce) and with fragment_sync_delay 4 (the
all-reduce starts 4 steps early and travels while they compute). Rank 0 prints the mean
seconds per step of each, taking turns for --rounds rounds of 24 steps, and their ratio.
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def worker(rounds):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    import distributed_utils as du

    backend = du.initialize()
    x = mx.random.normal((32, 1024), key=mx.random.key(du.local_rank(backend)))
    seconds = {0: [], 4: []}
    for _ in range(rounds):
        for delay in seconds:
            mx.random.seed(0)
            model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 1024))
            opt = du.DiLoCo(backend, optim.AdamW(1e-3), sync_every=8, fragment_sync_delay=delay)
            step = nn.value_and_grad(model, lambda m: (m(x) ** 2).mean())
            for s in range(25):  # the first step, with its checks, is not timed
                if s == 1:
                    du.barrier(backend)
                    start = time.perf_counter()
                _, grads = step(model)
                opt.update(model, grads)
                mx.eval(model.parameters(), opt.state)
            du.barrier(backend)
            seconds[delay].append((time.perf_counter() - start) / 24)
    if du.local_rank(backend) == 0:
        mean = {d: sum(t) / len(t) for d, t in seconds.items()}
        print(
            f"RESULT no delay {mean[0] * 1e3:.0f} ms/step, fragment_sync_delay=4 {mean[4] * 1e3:.0f} ms/step, "
            f"ratio {mean[4] / mean[0]:.2f}",
            flush=True,
        )


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rate", default="100mbit")
    p.add_argument("--backends", nargs="+", default=["ring", "mpi"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--worker", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args.rounds)
    from hosts import made_hosts

    with made_hosts() as hosts:
        hosts.shape(args.rate)
        for backend in args.backends:
            argv = ["python", __file__, "--worker", "--rounds", str(args.rounds)]
            done = subprocess.run(
                hosts.launcher(backend, argv), cwd=ROOT, capture_output=True, text=True, timeout=900
            )
            lines = [line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line]
            print(
                f"{backend}, {args.rate}: "
                + (lines[0] if lines else f"failed:\n{done.stdout}\n{done.stderr}")
            )


if __name__ == "__main__":
    main()
