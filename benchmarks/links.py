"""Reductions and training over slow links: two hosts made of network namespaces (tests/hosts.py),
the veth between them shaped with tc's token bucket filter. Needs root, iproute2 and unshare.

    python benchmarks/links.py [--backends mpi ring] [--rates 10gbit 1gbit 100mbit] [--budget 45] [--configs ...]
        [--plot docs/images/links]   (a picture of the loss against time for each backend and rate)

1. The gradient reduction (``du.reduce_gradients``, 2 ranks, one per host) against the link's own
   limit, bytes x 2(N-1)/N / rate, as a ratio (1.0 is the wire's speed), float32 and bfloat16; and
   a fully sharded unit's reduce-scatter of the same float32 gradients, against bytes x (N-1)/N / rate.
2. Training at an equal wall-clock budget (``--budget`` seconds at 100 Mbit/s, half of it at
   1 Gbit/s): a byte-level Llama from examples/llama_tinystories.py (4 layers, 128 dims, MLP
   256: 0.72M parameters, 2.9 MB) on generated stories, AdamW 1e-3, batch 4 x 32 tokens per rank:
   synchronous ``DistributedOptimizer`` against ``DiLoCo`` (H = 10 and 50; fragments; int8; a
   fragment's sync overlapped with 5 inner steps; the sparse codec, SparseLoCo's). Every run checks the budget every 10 steps
   (a 1-byte all-reduce). Reported: steps,
   steps/s, MB each host sent (the veth's counters), rank 0's training loss at the end (a
   moving average), the same at the step every DiLoCo run reached, and when each DiLoCo run first
   reached the synchronous run's final loss, as a fraction of the synchronous run's time. With
   "local (no sync)" among the runs: KB per sync, each run's bytes less that run's (the start's).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))

CONFIGS = {  # name: DiLoCo's arguments (None: synchronous)
    "sync": None,
    "diloco H=10": dict(sync_every=10),
    "diloco H=50": dict(sync_every=50),
    "diloco H=50 F=5": dict(sync_every=50, fragments=5),
    "diloco H=50 int8": dict(sync_every=50, compression="int8"),
    "diloco H=50 F=5 delay=5": dict(sync_every=50, fragments=5, fragment_sync_delay=5),
    "diloco H=50 sparse": dict(sync_every=50, compression="sparse"),  # SparseLoCo's defaults, outer SGD(1.0)
    "diloco H=30": dict(sync_every=30),  # (the codecs at SparseLoCo's H)
    "diloco H=30 int8": dict(sync_every=30, compression="int8"),
    "diloco H=30 sparse": dict(sync_every=30, compression="sparse"),
    "local (no sync)": dict(sync_every=10**9),  # the bytes every run sends besides its syncs
}
REDUCTIONS = {"float32": [], "bfloat16": ["--compression", "bfloat16"], "reduce-scatter": ["--scatter"]}
CHECK_EVERY = 10  # steps between two budget checks (a collective: it would end a delayed sync's overlap)


def collate_bytes(items):
    """Stories -> (tokens, mask): each a row of 33 bytes, 256 as the end of text (and the padding)."""
    import mlx.core as mx
    import numpy as np

    tokens, mask = np.full((len(items), 33), 256, np.int32), np.zeros((len(items), 33), np.float32)
    for i, item in enumerate(items):
        row = (list(item["text"].encode()) + [256])[:33]
        tokens[i, : len(row)], mask[i, : len(row)] = row, 1
    return mx.array(tokens), mx.array(mask)


def reduce_worker(args):
    import mlx.core as mx

    import distributed_utils as du

    from distributed_utils.reduction import Reduction

    backend = du.initialize()
    grads = {f"w{i}": mx.random.normal((args.bytes // 32 * 2,)) for i in range(4)}  # (even lengths)
    mx.eval(grads)
    times = []
    for _ in range(args.reps + 1):
        du.barrier(backend)
        start = time.perf_counter()
        if args.scatter:  # a fully sharded unit's gradients: each rank its half of the sum
            mx.eval(Reduction(backend).reduce(grads, scatter=True).wait())
        else:
            mx.eval(du.reduce_gradients(backend, grads, compression=args.compression))
        times.append(time.perf_counter() - start)
    slowest = du.allreduce(backend, statistics.median(times[1:]), "max")
    if du.local_rank(backend) == 0:
        print("RESULT", json.dumps({"seconds": slowest}), flush=True)


def train_worker(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from llama_tinystories import GeneratedStories, Llama, loss_fn

    import distributed_utils as du

    backend = du.initialize()
    mx.random.seed(0)
    model = Llama(vocab=257, dims=128, mlp_dims=256)
    du.synchronize(backend, model)
    config = CONFIGS[args.config]
    opt = (
        du.DistributedOptimizer(backend, optim.AdamW(1e-3))
        if config is None
        else du.DiLoCo(backend, optim.AdamW(1e-3), **config)
    )

    data = du.DistributedDataContainer(backend, GeneratedStories(100_000), collate=collate_bytes)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    start, steps, average, trace = time.perf_counter(), 0, None, []
    for tokens, mask in data.batches(4, shuffle=True):
        (loss, ntoks), grads = loss_and_grad(model, tokens, mask)
        opt.update(model, grads, weight=ntoks)
        mx.eval(loss, model.parameters(), opt.state)
        steps += 1
        average = loss.item() if average is None else 0.98 * average + 0.02 * loss.item()
        trace.append((time.perf_counter() - start, average))
        if steps % CHECK_EVERY == 0 and du.allreduce(
            backend, time.perf_counter() - start > args.budget, "max"
        ):
            break  # (1 byte, every run alike, right after a sync step of every configuration above)
    if du.local_rank(backend) == 0:
        result = {
            "steps": steps,
            "seconds": time.perf_counter() - start,
            "loss": average,
            "trace": trace[::5],
            "syncs": 0 if config is None else steps // config["sync_every"],
        }
        print("RESULT", json.dumps(result), flush=True)


def run(hosts, backend, worker_args, timeout):
    argv = ["python", __file__, "--worker", *worker_args]
    before = hosts.sent_bytes()
    done = subprocess.run(
        hosts.launcher(backend, argv), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    sent = [b - a for a, b in zip(before, hosts.sent_bytes())]
    for line in done.stdout.splitlines():
        if "RESULT " in line:
            return {**json.loads(line.split("RESULT ", 1)[1]), "sent": max(sent)}
    raise RuntimeError(f"{backend} {worker_args} failed:\n{done.stdout}\n{done.stderr}")


def reached(trace, loss):
    return next((t for t, average in trace if average <= loss), None)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backends", nargs="+", default=["mpi", "ring"])
    p.add_argument("--rates", nargs="*", default=["10gbit", "1gbit", "100mbit"])
    p.add_argument("--train-rates", nargs="*", default=["100mbit", "1gbit"])
    p.add_argument(
        "--budget", type=float, default=45.0, help="seconds of training at 100 Mbit/s (half at 1 Gbit/s)"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--configs", nargs="+", default=list(CONFIGS), help="training runs (sync first: the target loss)"
    )
    p.add_argument("--plot", help="PREFIX: PREFIX-{backend}-{rate}.png, the training loss against time")
    p.add_argument("--worker", nargs=argparse.REMAINDER)
    args = p.parse_args()
    if args.worker:
        w = argparse.ArgumentParser()
        w.add_argument("kind")
        w.add_argument("--bytes", type=int)
        w.add_argument("--reps", type=int)
        w.add_argument("--compression")
        w.add_argument("--scatter", action="store_true")
        w.add_argument("--config")
        w.add_argument("--budget", type=float)
        wargs = w.parse_args(args.worker)
        return (reduce_worker if wargs.kind == "reduce" else train_worker)(wargs)

    from hosts import made_hosts

    with made_hosts() as hosts:
        print(
            "| backend | link | MB | float32: s | ratio to the link's limit | bfloat16: s | ratio "
            "| reduce-scatter: s | ratio |"
        )
        print("| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for backend in args.backends:
            for rate in args.rates:
                bits = float(rate[:-4]) * (1e9 if rate.endswith("gbit") else 1e6)
                nbytes = int(min(113e6, bits / 8 * 2))  # about 2 s of the link, at most 113 MB
                hosts.shape(rate)
                row = []
                for mode in REDUCTIONS:
                    # bytes x 2(N-1)/N for an all-reduce, (N-1)/N for a reduce-scatter (N = 2)
                    wire = {"float32": nbytes, "bfloat16": nbytes / 2, "reduce-scatter": nbytes / 2}[mode]
                    limit = wire / (bits / 8)
                    worker = ["reduce", "--bytes", str(nbytes), "--reps", str(args.reps)]
                    worker += REDUCTIONS[mode]  # (the worker's flags)
                    got = run(hosts, backend, worker, 600)
                    row += [f"{got['seconds']:.3f}", f"{got['seconds'] / limit:.2f}"]
                print(f"| {backend} | {rate} | {nbytes / 1e6:.0f} | " + " | ".join(row) + " |", flush=True)
        hosts.shape(None)
        for backend in args.backends:
            for rate in args.train_rates:
                hosts.shape(rate)
                budget = args.budget if rate.endswith("mbit") else args.budget / 2
                results = {
                    c: run(hosts, backend, ["train", "--config", c, "--budget", str(budget)], 600)
                    for c in args.configs
                }
                target = results["sync"]["loss"]
                common = min(len(r["trace"]) for name, r in results.items() if name != "sync") - 1
                base = results.get("local (no sync)", {"sent": 0})
                print(
                    f"\n{backend}, {rate}, {budget:g} s each: | run | steps | steps/s | MB sent per host | "
                    f"KB per sync | loss | loss at step {5 * common + 1} | reached sync's final loss after |"
                )
                for name, r in results.items():
                    extra = r["sent"] - base["sent"]  # (the budget checks: about 0.1 KB each)
                    per_sync = f"{extra / r['syncs'] / 1e3:.1f}" if r["syncs"] else "-"
                    t = reached(r["trace"], target)
                    when = (
                        "-"
                        if t is None or name == "sync"
                        else f"{t / results['sync']['seconds']:.2f} of sync's time"
                    )
                    print(
                        f"| {name} | {r['steps']} | {r['steps'] / r['seconds']:.2f} | {r['sent'] / 1e6:.3f} | "
                        f"{per_sync} | {r['loss']:.3f} | {r['trace'][min(common, len(r['trace']) - 1)][1]:.3f} | "
                        f"{when} |",
                        flush=True,
                    )
                if args.plot:
                    import plots

                    curves = {name: r["trace"] for name, r in results.items()}
                    title = (
                        f"{backend}, 2 hosts joined by {rate}: training loss (moving average) against time"
                    )
                    plots.lines(f"{args.plot}-{backend}-{rate}.png", title, curves, "seconds", "loss")


if __name__ == "__main__":
    main()
