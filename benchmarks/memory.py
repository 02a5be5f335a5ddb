"""Memory per rank as the ranks grow: the TinyStories Llama example (28.4M parameters, AdamW)
on 1, 2 and 4 ranks at the same per-rank batch, side by side in one run.

    python benchmarks/memory.py                 # options: --backend mpi --ns 1 2 4 --steps 3 --block 64

Each rank reads and tokenizes only the stories of its own batches (the example's ``collate``),
so its memory should not grow with the number of ranks (the goal: within 1.1x of one process).
Reported per world size, the largest over the ranks: MLX's peak memory and the process's peak
resident set (RSS, which includes the Python interpreter, MLX, MPI and their libraries).
"""

import argparse
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ROW = re.compile(r"\[rank 0\] rank (\d+): .* peak memory +([\d.]+) MiB  peak RSS +([\d.]+) MiB")


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backend", default="mpi")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=2)
    args = parser.parse_args()

    rows = {}
    for n in args.ns:
        command = [
            sys.executable,
            "-m",
            "distributed_utils.launch",
            "-n",
            str(n),
            "--backend",
            args.backend,
            sys.executable,
            str(ROOT / "examples" / "llama_tinystories.py"),
            "--data",
            "generated",
            "--steps",
            str(args.steps),
            "--block",
            str(args.block),
            "--batch-size",
            str(args.batch_size),
        ]
        run = subprocess.run(command, capture_output=True, text=True, cwd=ROOT)
        found = [(float(m), float(r)) for _, m, r in ROW.findall(run.stdout)]
        if run.returncode or len(found) != n:
            sys.exit(f"{n} ranks failed (exit code {run.returncode}):\n{run.stdout}{run.stderr}")
        rows[n] = (max(m for m, _ in found), max(r for _, r in found))

    first = rows[args.ns[0]]
    print(
        f"{args.backend}, per-rank batch {args.batch_size} x {args.block} tokens, {args.steps} steps; "
        f"the largest rank; ratios to {args.ns[0]} rank(s)"
    )
    print(f"{'ranks':>5}{'MLX peak MiB':>14}{'ratio':>7}{'peak RSS MiB':>14}{'ratio':>7}")
    for n, (mlx_peak, rss) in rows.items():
        print(f"{n:>5}{mlx_peak:>14.1f}{mlx_peak / first[0]:>7.2f}{rss:>14.1f}{rss / first[1]:>7.2f}")


if __name__ == "__main__":
    main()
