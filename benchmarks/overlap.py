"""Does a step hide its communication behind its compute? Two hosts made of network namespaces
(tests/hosts.py), the veth between them shaped with tc's token bucket filter. Needs root.

    python benchmarks/overlap.py [--backends mpi ring mlx-mpi] [--rates 100mbit 200mbit 1gbit] [--steps 12]
    python benchmarks/overlap.py --picture docs/images/overlap.png [--backends ring] [--rates 200mbit]

One rank per host trains the byte-level Llama of benchmarks/links.py (0.72M parameters, 2.9 MB of
float32 gradients), AdamW, 4 x 33 tokens a rank and step. In one job, taking turns for ``--rounds``
rounds, rank 0 reports the median step time of the slowest rank (after a warm-up step) of:
- compute: the step with no collective (forward, backward, the optimizer's update, all on this rank);
- reduction: ``du.reduce_gradients`` of the step's gradients, already computed (the communication alone);
- `DistributedOptimizer`: the step, its reduction started bucket by bucket during the backward pass;
- `average_gradients`: MLX's ``mlx.nn.average_gradients`` then the optimizer (MLX's backends and MPI);
- `fully_shard`: every block, then the root, fully sharded (its gathers and reduce-scatters);
and the ratio of each step to max(compute, reduction): 1.0 hides all of the shorter one, 2.0 none.

``--picture PNG``: instead, one job of `DistributedOptimizer` steps alone (the first backend and rate),
run with ``du-launch --timeline``, and its last steps drawn, a row per rank: computing, each bucket's
sum started (it travels on while the rank computes on), and the wait at the step's end for the sums
still travelling.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
METHODS = ("compute", "reduction", "DistributedOptimizer", "average_gradients", "fully_shard")


def worker(steps, rounds, methods):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    import numpy as np
    from llama_tinystories import Llama, loss_fn

    import distributed_utils as du

    backend = du.initialize()
    rank = du.local_rank(backend)
    rng = np.random.default_rng(rank)
    tokens = mx.array(rng.integers(0, 256, (4, 33)), mx.int32)
    mask = mx.ones((4, 33), mx.float32)

    def model_and_step(method):
        mx.random.seed(0)
        model = Llama(vocab=257, dims=128, mlp_dims=256)
        du.synchronize(backend, model)
        if method == "fully_shard":
            for layer in model.layers:
                du.fully_shard(backend, layer)
            du.fully_shard(backend, model)
        loss_and_grad = nn.value_and_grad(model, lambda m: loss_fn(m, tokens, mask)[0])
        inner = optim.AdamW(1e-3)
        opt = inner if method in ("compute", "average_gradients") else du.DistributedOptimizer(backend, inner)
        grads = loss_and_grad(model)[1]
        mx.eval(grads)

        def step():
            if method == "reduction":
                mx.eval(du.reduce_gradients(backend, grads))
                return
            loss, g = loss_and_grad(model)
            if method == "average_gradients":
                g = nn.average_gradients(g)
            opt.update(model, g)
            mx.eval(loss, model.parameters(), opt.state)

        return step

    seconds = {m: [] for m in methods}
    for _ in range(rounds):
        for method in methods:
            step = model_and_step(method)
            step()  # (the first step, with its checks, is not timed)
            for _ in range(steps):
                du.barrier(backend)
                start = time.perf_counter()
                step()
                seconds[method].append(time.perf_counter() - start)
    medians = {m: du.allreduce(backend, statistics.median(t), "max") for m, t in seconds.items()}
    if rank == 0:
        print("RESULT", json.dumps(medians), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backends", nargs="+", default=["mpi", "ring", "mlx-mpi"])
    p.add_argument("--rates", nargs="+", default=["100mbit", "200mbit", "1gbit"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--picture", help="a PNG of a DistributedOptimizer job's timeline, instead of the table")
    p.add_argument("--worker", nargs="*", help=argparse.SUPPRESS)  # (the methods a rank times)
    args = p.parse_args()
    if args.worker is not None:
        return worker(args.steps, args.rounds, args.worker or METHODS)

    from hosts import made_hosts

    if args.picture:
        return picture(args, made_hosts)

    head = " | ".join(f"{m} s" for m in METHODS[2:])
    print(
        f"| link | backend | compute s | reduction s | {head} | "
        + " | ".join(f"{m} / max" for m in METHODS[2:])
        + " |"
    )
    print("| --- | --- |" + " ---: |" * (2 + 2 * len(METHODS[2:])))
    with made_hosts() as hosts:
        for rate in args.rates:
            hosts.shape(rate)
            for backend in args.backends:
                argv = [
                    "python",
                    __file__,
                    "--steps",
                    str(args.steps),
                    "--rounds",
                    str(args.rounds),
                    "--worker",
                ]
                done = subprocess.run(
                    hosts.launcher(backend, argv), cwd=ROOT, capture_output=True, text=True, timeout=900
                )
                found = [
                    line.split("RESULT ", 1)[1] for line in done.stdout.splitlines() if "RESULT " in line
                ]
                if not found:
                    print(
                        f"| {rate} | {backend} | failed: {done.stdout[-2000:]} {done.stderr[-2000:]} |",
                        flush=True,
                    )
                    continue
                t = json.loads(found[0])
                most = max(t["compute"], t["reduction"])
                times = " | ".join(f"{t[m]:.3f}" for m in METHODS)
                ratios = " | ".join(f"{t[m] / most:.2f}" for m in METHODS[2:])
                print(f"| {rate} | {backend} | {times} | {ratios} |", flush=True)


def picture(args, made_hosts, steps=3):
    """One job of ``DistributedOptimizer`` steps with ``--timeline``; its last ``steps`` steps drawn."""
    from plots import _pyplot

    backend, rate = args.backends[0], args.rates[0]
    with made_hosts() as hosts, tempfile.TemporaryDirectory() as tmp:
        hosts.shape(rate)
        trace = f"{tmp}/trace.json"
        argv = ["--timeline", trace, "python", __file__, "--steps", "8", "--rounds", "1"]
        done = subprocess.run(
            hosts.launcher(backend, argv + ["--worker", "DistributedOptimizer"]),
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if done.returncode:
            raise SystemExit(f"the job failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
        events = json.loads(Path(trace).read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
    barriers = sorted(e["ts"] for e in events if e["pid"] == 0 and e["name"] == "barrier")
    t0 = barriers[-steps]  # (each timed step follows a barrier)
    colours = {"compute": "#bbbbbb", "start_sum": "#3b75af", "wait": "#ef8636"}
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 2.4))
    for row, pid in enumerate(sorted(names)):
        mine = [e for e in events if e["pid"] == pid and e["ph"] == "X" and e["ts"] >= t0]
        for e in sorted(mine, key=lambda e: e["name"] != "compute"):  # (the rest drawn over the compute)
            colour = next((c for name, c in colours.items() if e["name"].startswith(name)), "#555555")
            ax.broken_barh([((e["ts"] - t0) / 1e3, e["dur"] / 1e3)], (row - 0.35, 0.7), color=colour)
    ax.set_yticks(range(len(names)), [names[p] for p in sorted(names)])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds")
    legend = {
        "computing (forward, backward, update)": "#bbbbbb",
        "a bucket's sum started (it travels on)": "#3b75af",
        "waiting for the sums still travelling": "#ef8636",
        "other collectives (the tree's check, the benchmark's barrier)": "#555555",
    }
    for label, colour in legend.items():
        ax.bar(0, 0, color=colour, label=label)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncols=2)
    title = (
        f"DistributedOptimizer, {backend}, 2 hosts at {rate}: the last {steps} steps (du-launch --timeline)"
    )
    ax.set_title(title, fontsize=10)
    fig.savefig(args.picture, dpi=110, bbox_inches="tight")
    plt.close(fig)
    print(f"the picture: {args.picture}")


if __name__ == "__main__":
    main()
