"""What checksums cost a checkpoint: save and load of a parameter tree, against the CRC-32
(zlib's) of the same bytes alone, which is what a save adds once and a load adds once.

    python benchmarks/checkpoint.py [--params 28.4e6] [--reps 5] [--dir /tmp]

Medians over ``--reps`` runs, taking turns; one process (rank 0 does all the file work at any
world size). The files go to ``--dir`` (the page cache makes the load a memory read there).
"""

import argparse
import statistics
import tempfile
import time
import zlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

import distributed_utils as du


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=float, default=28.4e6)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dir", default=None)
    args = p.parse_args()
    backend = du.initialize()
    model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(int(args.params // (1024 * 1025)))])
    mx.eval(model.parameters())
    nbytes = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    with tempfile.TemporaryDirectory(dir=args.dir) as folder:
        path = f"{folder}/ck.safetensors"
        raw = [np.asarray(a) for _, a in tree_flatten(model.parameters())]
        runs = {"save": [], "load": [], "crc32": []}
        for _ in range(args.reps):
            for name, fn in (
                ("save", lambda: du.save_checkpoint(backend, path, model=model)),
                ("load", lambda: du.load_checkpoint(backend, path, model=model)),
                ("crc32", lambda: [zlib.crc32(r) for r in raw]),
            ):
                start = time.perf_counter()
                fn()
                runs[name].append(time.perf_counter() - start)
    t = {k: statistics.median(v) for k, v in runs.items()}
    print(
        f"{nbytes / 2**20:.0f} MiB: save {t['save'] * 1e3:.0f} ms, load {t['load'] * 1e3:.0f} ms, "
        f"crc32 {t['crc32'] * 1e3:.0f} ms ({nbytes / t['crc32'] / 1e9:.2f} GB/s): "
        f"checksums are {t['crc32'] / t['save']:.0%} of a save and {t['crc32'] / t['load']:.0%} of a load"
    )


if __name__ == "__main__":
    main()
