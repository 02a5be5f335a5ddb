"""DiLoCo's codecs at the same number of inner steps: the loss of float32, int8 and the sparse codec
(SparseLoCo's, outer SGD(1.0)) pseudo-gradients, on 2 ranks of this machine (the loss does not depend on
the link: benchmarks/links.py measures the time and the bytes over shaped links).

    python benchmarks/diloco_codecs.py [--backend ring] [--sync-every 30] [--steps 300] [--seeds 0 1]

The model and data of benchmarks/links.py (a byte-level Llama of 0.72M parameters on generated stories,
AdamW 1e-3, batch 4 x 32 tokens per rank). Reported per codec and seed: rank 0's training loss at the
last step (a moving average, 0.98) and the loss of the global parameters on 64 held-out stories at the
last sync; then each codec's mean over the seeds, as a ratio to float32's."""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CODECS = [None, "int8", "sparse"]


def worker(codec, seed, sync_every, steps):
    sys.path.insert(0, str(ROOT / "examples"))
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from links import collate_bytes  # (benchmarks/links.py's model and data)
    from llama_tinystories import GeneratedStories, Llama, loss_fn

    import distributed_utils as du

    backend = du.initialize()
    mx.random.seed(seed)
    model = Llama(vocab=257, dims=128, mlp_dims=256)
    du.synchronize(backend, model)
    opt = du.DiLoCo(backend, optim.AdamW(1e-3), sync_every=sync_every, compression=codec)

    held_out = collate_bytes([GeneratedStories(64, seed=99)[i] for i in range(64)])
    data = du.DistributedDataContainer(backend, GeneratedStories(100_000, seed=seed), collate=collate_bytes)
    loss_and_grad = nn.value_and_grad(model, loss_fn)
    average, step, synced = None, 0, None
    for tokens, mask in data.batches(4, shuffle=True):
        (loss, ntoks), grads = loss_and_grad(model, tokens, mask)
        opt.update(model, grads, weight=ntoks)
        mx.eval(loss, model.parameters(), opt.state)
        step += 1
        average = loss.item() if average is None else 0.98 * average + 0.02 * loss.item()
        if step % sync_every == 0:  # (the model holds the global parameters, the same on every rank)
            synced = loss_fn(model, *held_out)[0].item()
        if step == steps:
            break
    if backend.rank == 0:
        print("RESULT", json.dumps({"train": average, "held_out": synced}), flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="ring")
    p.add_argument("--sync-every", type=int, default=30)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--worker", nargs=2)
    args = p.parse_args()
    if args.worker:
        codec = None if args.worker[0] == "float32" else args.worker[0]
        return worker(codec, int(args.worker[1]), args.sync_every, args.steps)
    results = {}
    for codec in CODECS:
        name = codec or "float32"
        for seed in args.seeds:
            command = [sys.executable, "-m", "distributed_utils.launch", "-n", "2", "--backend", args.backend]
            command += [sys.executable, __file__, "--sync-every", str(args.sync_every)]
            command += ["--steps", str(args.steps), "--worker", name, str(seed)]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
            line = next((x for x in done.stdout.splitlines() if "RESULT " in x), None)
            if line is None:
                raise RuntimeError(f"{name} seed {seed} failed:\n{done.stdout}\n{done.stderr}")
            results[name, seed] = json.loads(line.split("RESULT ", 1)[1])
            print(f"{name:8} seed {seed}: {results[name, seed]}", flush=True)
    print(f"\nH = {args.sync_every}, {args.steps} inner steps, seeds {args.seeds}, {args.backend}, 2 ranks")
    print("| codec | training loss (mean) | / float32 | held-out loss at the last sync (mean) | / float32 |")
    print("| --- | ---: | ---: | ---: | ---: |")
    base = {k: statistics.mean(results["float32", s][k] for s in args.seeds) for k in ("train", "held_out")}
    for codec in CODECS:
        name = codec or "float32"
        mean = {k: statistics.mean(results[name, s][k] for s in args.seeds) for k in ("train", "held_out")}
        ratios = {k: mean[k] / base[k] for k in mean}
        print(
            f"| {name} | {mean['train']:.4f} | {ratios['train']:.2f} | {mean['held_out']:.4f} "
            f"| {ratios['held_out']:.2f} |"
        )


if __name__ == "__main__":
    main()
