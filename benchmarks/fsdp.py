"""Memory and time per rank of replicated data parallelism, sharded optimizer state (ZeRO-1)
and du.fully_shard (FSDP), side by side in one run, at N = 1, 2 and 4 ranks.

    python benchmarks/fsdp.py                       # options: --backend mpi --ns 1 2 4 --steps 4
    python benchmarks/fsdp.py --dims 512 --layers 8 --vocab 256   # blocks hold most parameters
    python benchmarks/fsdp.py --limit-mib 700 --ns 4 --modes replicated fsdp   # a per-rank limit
    python benchmarks/fsdp.py --plot docs/images/fsdp.png    # and the table as a picture

The model is examples/llama_tinystories.py's Llama (default 4 layers, 256 dims: 28.4M float32
parameters, 91% of them in the embedding and output layers), AdamW, random tokens (2 x 64 a rank
and step); with ``fully_shard``, every block, the embedding, the output layer, then the root
("fsdp-layers": each Linear and norm of the blocks first, each a unit of its own, so that no block
is recomputed). Each mode and world size is a job of its own (``du-launch``), so that each peak is
its own. Reported per job, the largest over the ranks: MLX's peak memory, the process's peak RSS,
the median step time (after one warm-up step), and the final loss (the same data in every mode: the
losses must agree). ``--limit-mib`` caps each rank's data memory (``RLIMIT_DATA``: what malloc may
map) at its size before the model plus this many MiB; a job that cannot train under it fails
(reported as such).
"""

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODES = ("replicated", "zero1", "fsdp", "fsdp-keep", "fsdp-layers")  # fsdp-keep: reshard_after_forward=False


def rank_main(args):
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    sys.path.insert(0, str(ROOT / "examples"))
    from llama_tinystories import Llama

    import distributed_utils as du

    backend = du.initialize()
    if args.limit_mib:  # what malloc may map from here on: the model, its training, and this much
        data = int(Path("/proc/self/statm").read_text().split()[5]) * resource.getpagesize()
        limit = data + args.limit_mib * 2**20
        resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))
    mx.random.seed(0)
    model = Llama(vocab=args.vocab, dims=args.dims, n_layers=args.layers, n_heads=4, mlp_dims=2 * args.dims)
    if args.mode.startswith("fsdp"):  # ("fsdp-layers": each Linear and norm of the blocks first, as units)
        kinds = (nn.Linear, nn.RMSNorm) if args.mode == "fsdp-layers" else ()
        layers = [m for block in model.layers for _, m in block.named_modules() if isinstance(m, kinds)]
        for unit in [*layers, *model.layers, model.embed, model.lm_head, model]:  # then the root
            du.fully_shard(backend, unit, reshard_after_forward=args.mode != "fsdp-keep")
    else:
        du.synchronize(backend, model)
    mx.eval(model.parameters())
    opt = du.DistributedOptimizer(backend, optim.AdamW(1e-3), shard_optimizer_state=args.mode == "zero1")

    def loss_fn(model, tokens):
        return nn.losses.cross_entropy(model(tokens[:, :-1]), tokens[:, 1:]).mean()

    step = nn.value_and_grad(model, loss_fn)
    mx.random.seed(1)
    every = mx.random.randint(
        0, min(args.vocab, 256), (args.steps, backend.size * args.batch, args.block + 1)
    )
    times, losses = [], []
    for s in range(args.steps):
        rows = every[s, backend.rank * args.batch : (backend.rank + 1) * args.batch]
        tic = time.perf_counter()
        loss, grads = step(model, rows)
        opt.update(model, grads)
        mx.eval(loss, model.parameters(), opt.state)
        del grads  # (fully_shard's backward pass runs inside step(): the last step's would still be held)
        times.append(time.perf_counter() - tic)
        losses.append(du.allreduce(backend, loss, "avg").item())
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    mine = {"peak": mx.get_peak_memory() / 2**20, "rss": rss, "step": statistics.median(times[1:] or times)}
    rows = du.allgather(backend, mine)
    params = sum(a.size for _, a in tree_flatten(model.parameters()))
    if backend.rank == 0:
        worst = {key: max(r[key] for r in rows) for key in mine}
        print("RESULT " + json.dumps({**worst, "loss": losses[-1], "params_per_rank": params}), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="mpi")
    p.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--dims", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--limit-mib", type=int, default=0)
    p.add_argument("--plot", help="a PNG of the table: MLX peak and step time by world size and mode")
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)  # (a rank of one job)
    p.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.rank:
        return rank_main(args)
    passed = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(args).items()
        if k not in ("ns", "modes", "rank", "mode", "backend")
    ]
    print(
        f"{args.backend}: Llama dims {args.dims}, {args.layers} layers; {args.batch} x {args.block} tokens a rank and step; limit {args.limit_mib or 'none'} MiB"
    )
    print(
        f"{'ranks':>5} {'mode':<11}{'params/rank':>12}{'MLX peak MiB':>14}{'peak RSS MiB':>14}{'step s':>8}{'/ repl.':>8}{'loss':>9}"
    )
    table = {}  # (n, mode): the job's result
    for n in args.ns:
        base = None
        for mode in args.modes:
            command = [
                sys.executable,
                "-m",
                "distributed_utils.launch",
                "-n",
                str(n),
                "--backend",
                args.backend,
            ]
            command += [sys.executable, __file__, "--rank", f"--mode={mode}", *passed]
            run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
            found = re.search(r"RESULT (\{.*\})", run.stdout)
            if run.returncode or not found:
                last = (run.stdout + run.stderr).strip().splitlines()[-1:]
                print(f"{n:>5} {mode:<11}failed (exit code {run.returncode}): {last[0] if last else ''}")
                continue
            r = table[n, mode] = json.loads(found.group(1))
            base = base or (r["step"] if mode == "replicated" else None)
            ratio = f"{r['step'] / base:.2f}" if base else ""
            print(
                f"{n:>5} {mode:<11}{r['params_per_rank'] / 1e6:>11.2f}M{r['peak']:>14.1f}{r['rss']:>14.1f}{r['step']:>8.3f}{ratio:>8}{r['loss']:>9.4f}",
                flush=True,
            )
    if args.plot:
        plot(args, table)


def plot(args, table):
    import plots

    ns = [f"N = {n}" for n in args.ns]
    base = {n: table.get((n, "replicated"), {}).get("step") for n in args.ns}
    peak = {m: [table.get((n, m), {}).get("peak") for n in args.ns] for m in args.modes}
    step = {
        m: [table[n, m]["step"] / base[n] if (n, m) in table and base[n] else None for n in args.ns]
        for m in args.modes
    }
    panels = [("MLX peak MiB per rank", ns, peak), ("step time / replicated's", ns, step)]
    title = f"{args.backend}: Llama dims {args.dims}, {args.layers} layers, vocabulary {args.vocab}"
    plots.bars(args.plot, title, panels)


if __name__ == "__main__":
    main()
