"""Peak memory per rank of DistributedDataContainer over a memory-mapped file.

    python benchmarks/data_memory.py [--mb 400] [-n 2] [--backend mpi]

Writes a raw float32 file of about ``--mb`` MB (rows of 4 KiB, so a row is a page) in a temp
dir, then runs ``-n`` ranks under du-launch once per mode and prints, for each rank, the MiB
of rows it read, its peak RSS (VmHWM, which counts the file pages mapped into it) and its peak
private memory (RssAnon, sampled after every batch: what the process itself allocated):

  baseline   imports, backend, np.memmap and the container; no batch read
  shard      iterate this rank's batches in order
  shuffled   iterate this rank's batches with shuffle=True
  load-all   for contrast: every rank copies the whole file into memory (np.array(memmap))

Expected: shard stays near baseline + file / n in RSS; shuffled reads file / n too, but its rows
are spread over the whole file and the kernel maps neighbouring cached pages on each fault
("fault-around"), so its RSS can reach the file size: those are shared, clean page-cache pages,
one copy for all ranks. Private memory stays near baseline for both; load-all adds the file.
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np

ROW = 1024  # float32 values per row: 4 KiB
MODES = ("baseline", "shard", "shuffled", "load-all")


def status_mb(field: str) -> float:
    """A memory field of /proc/self/status in MiB (Linux); elsewhere the peak RSS for all."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1024
    except (OSError, StopIteration):  # not Linux: ru_maxrss is bytes on macOS
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def worker(path: str, rows: int, mode: str):
    import mlx.core as mx

    import distributed_utils as du

    backend = du.initialize()
    data = np.memmap(path, np.float32, "r", shape=(rows, ROW))
    container = du.DistributedDataContainer(backend, data)
    read, private = 0, status_mb("RssAnon")
    if mode in ("shard", "shuffled"):
        for batch in container.batches(256, shuffle=mode == "shuffled", seed=0):
            mx.eval(batch.sum())
            read += batch.shape[0]
            private = max(private, status_mb("RssAnon"))
    elif mode == "load-all":
        whole = np.array(data)
        read, private = len(whole), max(private, status_mb("RssAnon"))
    report = {
        "rank": du.local_rank(backend),
        "read_mb": read * ROW * 4 / 2**20,
        "peak_mb": status_mb("VmHWM"),
        "private_mb": private,
    }
    everyone = du.allgather(backend, report)
    if du.local_rank(backend) == 0:
        print("RESULT " + json.dumps(everyone), flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mb", type=int, default=400, help="file size in MB (default 400)")
    p.add_argument("-n", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--backend", default="mpi", help="du-launch backend (default mpi)")
    p.add_argument("--worker", nargs=3, metavar=("PATH", "ROWS", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker[0], int(args.worker[1]), args.worker[2])

    rows = args.mb * 2**20 // (ROW * 4)
    file_mb = rows * ROW * 4 / 2**20
    print(
        f"{args.n} ranks ({args.backend}), memory-mapped float32 file of {rows} rows x {ROW} = {file_mb:.0f} MiB"
    )
    print(f"file / n = {file_mb / args.n:.0f} MiB per rank; all columns in MiB")
    print(
        f"{'mode':<10} {'rank':>4} {'rows read':>10} {'peak RSS':>9} {'above baseline':>15} {'peak private':>13}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.f32")
        out = np.memmap(path, np.float32, "w+", shape=(rows, ROW))
        for start in range(0, rows, 4096):  # chunked, so this process stays small too
            out[start : start + 4096] = np.arange(start, min(start + 4096, rows), dtype=np.float32)[:, None]
        out.flush()
        del out
        baseline = {}
        for mode in MODES:
            cmd = [
                sys.executable,
                "-m",
                "distributed_utils.launch",
                "-n",
                str(args.n),
                "--backend",
                args.backend,
                sys.executable,
                os.path.abspath(__file__),
                "--worker",
                path,
                str(rows),
                mode,
            ]
            run = subprocess.run(cmd, capture_output=True, text=True)
            result = [line.split("RESULT ", 1)[1] for line in run.stdout.splitlines() if "RESULT " in line]
            if run.returncode or not result:
                sys.exit(f"{mode}: du-launch failed ({run.returncode}):\n{run.stdout}\n{run.stderr}")
            for r in json.loads(result[0]):
                baseline.setdefault(r["rank"], r["peak_mb"])
                above = r["peak_mb"] - baseline[r["rank"]]
                print(
                    f"{mode:<10} {r['rank']:>4} {r['read_mb']:>10.0f} {r['peak_mb']:>9.0f} {above:>15.0f} "
                    f"{r['private_mb']:>13.0f}"
                )


if __name__ == "__main__":
    main()
