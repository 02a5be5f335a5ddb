"""The contract between du-launch and its ranks: the variables du-launch sets (``job_environment``),
the exit codes, and the JSON records a rank writes for du-launch (``record`` / ``read_record``, and their
events). And what a transport needs of the environment: the MPI library and its start, the ring's
addresses."""

import contextlib
import functools
import json
import os
import secrets
import shutil
import socket
import sys
import uuid
from pathlib import Path

import mlx.core as mx

from .base import BackendUnavailableError

#: The exit codes: a rank the watchdog ended (as timeout(1)); a job preempted that ended in time
#: (sysexits' EX_TEMPFAIL, "try again later", for a scheduler to requeue on); 128 + N for signal N.
WATCHDOG_EXIT = 124
PREEMPTED_EXIT = 75
SIGNAL_EXIT = 128

#: What a record's line begins with (then the job's token and the record's JSON): du-launch reads, and hides, it.
RECORD_PREFIX = "du-launch-record "
#: The events of the records (``record``), each read by du-launch (what each carries: docs/architecture.md).
ACCOUNT, FINISHED, MEASURED, PREEMPTED, WATCHDOG = "account", "finished", "measured", "preempted", "watchdog"


def job_environment(
    backend: str, world_size: int, report_dir: str, timeout=None, debug=False, restart=0, timeline=None
) -> dict:
    """What the launcher adds to every rank's environment (a ring rank's: and ``ring_rank_environment``'s)."""
    env = {k: os.environ[k] for k in ("DU_TIMEOUT", "DU_DEBUG") if k in os.environ}
    env.update(DU_REPORT_DIR=report_dir, DU_BACKEND=backend, DU_WORLD_SIZE=str(world_size), PATH=rank_path())
    env.update(DU_RESTART=str(restart), DU_JOB_ID=uuid.uuid4().hex, PYTHONUNBUFFERED="1")
    env["DU_RECORD_TOKEN"] = secrets.token_hex(16)  # (in every record: see ``record``)
    if os.isatty(1) and "COLUMNS" not in os.environ:  # for progress bars: the width left after "[rank R] "
        env["COLUMNS"] = str(max(20, shutil.get_terminal_size().columns - len(f"[rank {world_size - 1}] ")))
    # Transparent huge pages for MLX's large buffers too, as numpy asks for its own: on Linux, MPI's
    # average of 113 MB of gradients took 21 ms with them, 28-71 without (benchmarks/gradient_reduction.py).
    env["GLIBC_TUNABLES"] = os.environ.get("GLIBC_TUNABLES", "glibc.malloc.hugetlb=1")
    if timeout is not None:
        env["DU_TIMEOUT"] = str(timeout)
    if debug:
        env["DU_DEBUG"] = "1"
    if timeline:  # (--timeline FILE: each rank's at exit, see ``timeline_path``)
        env["DU_TIMELINE"] = os.path.abspath(timeline)
    if backend in ("mpi", "mlx-mpi"):
        if lib := os.environ.get("MLX_MPI_LIBNAME") or libmpi_path():
            env["MLX_MPI_LIBNAME"] = lib
        # A rank that aborts because it lost a peer waits a second first, so that mpirun hears
        # of the rank that died (the cause) before it hears of this one (an effect).
        env["OMPI_MCA_mpi_abort_delay"] = os.environ.get("OMPI_MCA_mpi_abort_delay", "1")
        # Two TCP connections between two hosts: over a 1 Gbit/s link one all-reduce took 1.43x
        # the wire's time with one, 1.06x with two (100 Mbit/s: 1.96x, 1.14x; benchmarks/links.py).
        env["OMPI_MCA_btl_tcp_links"] = os.environ.get("OMPI_MCA_btl_tcp_links", "2")
        # A reduce-scatter by the butterfly algorithm: Open MPI's own choice (reduce, then scatter) took 3x
        # the wire's time over 100 Mbit/s and 1 Gbit/s links, the butterfly 1.1x (benchmarks/links.py).
        for name, value in (
            ("coll_tuned_use_dynamic_rules", "1"),
            ("coll_tuned_reduce_scatter_block_algorithm", "4"),
        ):
            env[f"OMPI_MCA_{name}"] = os.environ.get(f"OMPI_MCA_{name}", value)
    return env


def rank_path() -> str:
    """The ranks' PATH: so that ``python`` in the command is the interpreter that runs du-launch."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def ring_rank_environment(rank: int, hostfile=None) -> dict:
    """A ring rank's own: its rank, and the addresses of every rank (a ring of one has none)."""
    return {"MLX_RANK": str(rank), **({"MLX_HOSTFILE": hostfile} if hostfile else {})}


def record(event: str, **fields):
    """The line that tells du-launch of ``event`` (written by this rank; du-launch reads and hides it), or None
    where du-launch did not start this process. It carries the job's secret (``DU_RECORD_TOKEN``): a line a
    program prints, or one from another job's log, is not this job's record but output, shown as it is."""
    token = os.environ.get("DU_RECORD_TOKEN")
    if not token:
        return None
    return f"{RECORD_PREFIX}{token} " + json.dumps({"event": event, "rank": launched_rank(), **fields})


def say_record(event: str, **fields):
    line = record(event, **fields)
    if line is not None:
        print(line, file=sys.stderr, flush=True)


def read_record(line: bytes, token):
    """The record (a dict naming its event) that ``line`` holds if it carries ``token`` (this job's
    ``DU_RECORD_TOKEN``), or None."""
    prefix = f"{RECORD_PREFIX}{token} ".encode()
    if token and line.startswith(prefix):
        with contextlib.suppress(ValueError):
            record = json.loads(line[len(prefix) :])
            if isinstance(record, dict) and isinstance(record.get("event"), str):  # (else forged: a line)
                return record
    return None


def listen_error(ip: str, port: int):
    """Why a socket cannot listen on ``ip:port`` now, as MLX's ring would (SO_REUSEADDR), or None."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def launched_backend_name():
    """``DU_BACKEND``, else "mpi" under mpirun, else None (a world of one)."""
    mpirun = "mpi" if _first_set("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") is not None else None
    return _first_set("DU_BACKEND", default=mpirun)


def _first_set(*names, default=None):
    return next((os.environ[name] for name in names if name in os.environ), default)


def launched_rank():
    """This process's rank as the launcher set it (before any backend knows it), or "?"."""
    rank = _first_set("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default="?")
    return int(rank) if rank.isdigit() else rank


def report_path():
    """Where this rank's watchdog also writes its report, or None."""
    folder = os.environ.get("DU_REPORT_DIR")
    return None if not folder else os.path.join(folder, f"rank-{launched_rank()}.report")


def watchdog_environment() -> dict:
    """What ``job_environment`` sets for a rank's watchdog: ``timeout`` (``DU_TIMEOUT``'s text, or None),
    ``debug`` (``DU_DEBUG``: on or off) and ``timeline`` (``DU_TIMELINE``'s file, or None)."""
    debug = os.environ.get("DU_DEBUG", "0").lower() not in ("", "0", "false", "no", "off")
    return dict(timeout=os.environ.get("DU_TIMEOUT"), debug=debug, timeline=os.environ.get("DU_TIMELINE"))


def launched_by_mlx(mlx_name: str) -> bool:
    """Whether a launcher started this process for MLX's backend ``mlx_name`` in a job of more than one."""
    variable = {"ring": "MLX_HOSTFILE", "nccl": "MLX_WORLD_SIZE", "jaccl": "MLX_IBV_DEVICES"}.get(mlx_name)
    return launched_by_mpirun() if mlx_name == "mpi" else variable in os.environ


def timeline_path(path: str, rank) -> str:  # (DU_TIMELINE=trace.json: trace.rank-R.json)
    return os.path.splitext(path)[0] + f".rank-{rank}.json"


def expected_world_size():
    """The number of processes the launcher (du-launch, or mpirun) started, or None."""
    size = _first_set("DU_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    return None if size is None else int(size)


def job_id():
    return os.environ.get("DU_JOB_ID")


def launched_by_mpirun() -> bool:
    return int(_first_set("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)) > 1


def check_ring_addresses():
    """Raise unless this rank can listen on its MLX_HOSTFILE addresses (MLX: "Couldn't bind socket")."""
    path = os.environ["MLX_HOSTFILE"]
    hosts = json.loads(Path(path).read_text())
    rank = os.environ.get("MLX_RANK", "")
    if not (rank.isdigit() and int(rank) < len(hosts)):
        raise BackendUnavailableError(
            f"RingBackend: MLX_RANK={rank!r} is not a rank of the {len(hosts)} hosts in MLX_HOSTFILE={path}"
        )
    for address in hosts[int(rank)]:
        ip, _, port = address.rpartition(":")
        error = listen_error(ip, int(port))
        if error:
            held = ": another program or job holds the port" if "in use" in error else ""
            raise BackendUnavailableError(
                f"RingBackend: rank {rank} cannot listen on {address} (from MLX_HOSTFILE): {error}{held}"
            )


def libmpi_path():
    """The real shared library behind ``mpirun``, or None when there is no MPI."""
    name = "libmpi.dylib" if sys.platform == "darwin" else "libmpi.so.40"
    mpirun = shutil.which("mpirun")
    dirs = [Path(sys.prefix) / "lib"] + ([Path(mpirun).resolve().parent.parent / "lib"] if mpirun else [])
    return next((str(d / name) for d in dirs if (d / name).exists()), None)


def mlx_available(mlx_name: str) -> bool:
    """Whether MLX has the backend ``mlx_name``. For "mpi" (whether MLX can load an MPI library), it points
    MLX_MPI_LIBNAME at the real libmpi first: MLX looks once, at the first question, and the wheel's
    ``libmpi.so`` is a linker script."""
    if mlx_name == "mpi" and "MLX_MPI_LIBNAME" not in os.environ and libmpi_path() is not None:
        os.environ["MLX_MPI_LIBNAME"] = libmpi_path()
    return mx.distributed.is_available(mlx_name)


@functools.cache  # (once: a call that raises is not cached)
def start_mlx_mpi():
    """Initialize MLX's MPI backend once under ``mpirun``, before mpi4py (after mpi4py's MPI_Init, MLX's is
    silently a world of one); BackendUnavailableError if mpi4py was first. Its callers check first that MLX
    can load an MPI library (``mlx_available("mpi")``)."""
    if not launched_by_mpirun():
        return
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        raise BackendUnavailableError(
            "MLX's MPI backend cannot start after mpi4py initialized MPI in this process; "
            "initialize MLXMPIBackend or MPIBackend (which starts MLX's side first) before "
            "importing mpi4py.MPI yourself"
        )
    mx.distributed.init(strict=True, backend="mpi")
