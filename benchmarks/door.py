"""What the library's door costs on a tiny collective: du's collectives against the transport's own call.

    du-launch -n 2 --backend mpi python benchmarks/door.py      (also --backend ring, mlx-mpi)

Every row is the mean of --reps calls after 50 warm-up calls, the methods taking turns in one
run; rank 0 prints microseconds per call and the ratio to the raw call. Raw: mpi4py's Allreduce
and Bcast on numpy buffers, and for an mx.array Allreduce reading its memory and the sum made an
mx.array (MPIBackend); or mx.distributed.all_sum of an mx.array, evaluated (MLX backends). du: the public collectives, through the door (checks, watchdog, evaluation).
Between them, the layers of ``du.allreduce(mx.array)``: the raw call inside the watchdog's
``collective``, the backend's primitive alone, and the door (``collectives.allreduce_arrays``).
"""

import argparse
import time

import mlx.core as mx
import numpy as np

import distributed_utils as du
from distributed_utils import collectives, watchdog


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2000)
    reps = parser.parse_args().reps
    backend = du.initialize()
    x, m = np.ones(4, np.float32), mx.ones(4)

    def per_call(f):
        for _ in range(50):
            f()
        du.barrier(backend)
        start = time.perf_counter()
        for _ in range(reps):
            f()
        return (time.perf_counter() - start) / reps * 1e6

    if isinstance(backend, du.MPIBackend):
        from mpi4py import MPI

        out = np.empty_like(x)

        def raw_mx():  # what a user of mpi4py writes for an mx.array: Allreduce reads its memory; the sum made an mx.array
            backend.comm.Allreduce(m, out, op=MPI.SUM)
            return mx.array(out)

        raw = {
            "allreduce": lambda: backend.comm.Allreduce(x, out, op=MPI.SUM),
            "bcast": lambda: backend.comm.Bcast(x),
            "allreduce of an mx.array": raw_mx,
        }
    else:
        raw = {"allreduce": lambda: mx.eval(mx.distributed.all_sum(m, group=backend.group, stream=mx.cpu))}
    raw_of_mx = "allreduce of an mx.array" if "allreduce of an mx.array" in raw else "allreduce"

    def watched():
        with watchdog.Collective(backend, "allreduce", ("sum",), m):
            raw["allreduce"]()

    rows = {
        "  raw allreduce, watched": ("allreduce", watched),
        "  backend.allreduce([mx.array])": ("allreduce", lambda: mx.eval(backend.allreduce([m], "sum"))),
        "  the door (collectives.allreduce_arrays)": (
            "allreduce",
            lambda: mx.eval(collectives.allreduce_arrays(backend, [m], "sum", what="allreduce")),
        ),
        "du.allreduce(mx.array of 4 floats)": (raw_of_mx, lambda: du.allreduce(backend, m, "sum")),
        "du.allreduce(numpy array of 4 floats)": ("allreduce", lambda: du.allreduce(backend, x, "sum")),
        "du.allreduce(a Python float)": ("allreduce", lambda: du.allreduce(backend, 1.0, "sum")),
        "du.bcast(mx.array of 4 floats)": ("bcast", lambda: du.bcast(backend, m)),
        "du.preempted(backend)": ("allreduce", lambda: du.preempted(backend)),
    }
    times = {f"raw {name}": per_call(f) for name, f in raw.items()}
    for name, (_, f) in rows.items():
        times[name] = per_call(f)
    if du.local_rank(backend) == 0:
        print(f"{type(backend).__name__}, {du.total_workers(backend)} processes, mean of {reps} calls")
        for name, us in times.items():
            base = times.get(f"raw {rows[name][0]}") if name in rows else us
            ratio = f"{us / base:6.1f}x" if base else ""
            print(f"  {name:40s} {us:8.1f} us  {ratio}")


if __name__ == "__main__":
    main()
