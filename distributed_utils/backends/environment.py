"""The contract between the launcher and the backends (its variables: docs/architecture.md,
"The launcher's contract"): how a process knows it was launched, where the MPI library is,
and the one order in which MLX's MPI and mpi4py can share it.
"""

import json
import os
import shutil
import socket
import sys
from pathlib import Path

from .base import BackendUnavailableError


def listen_error(ip: str, port: int):
    """Why a socket cannot listen on ``ip:port`` now, as MLX's ring would (SO_REUSEADDR), or None."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((ip, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


# --- the rank's side -----------------------------------------------------------------


def launched_backend_name():
    """``DU_BACKEND``, else "mpi" under mpirun, else None (a world of one)."""
    mpirun = "mpi" if _first_set("OMPI_COMM_WORLD_SIZE", "PMI_SIZE") is not None else None
    return _first_set("DU_BACKEND", default=mpirun)


def launcher_name() -> str:
    return "du-launch" if "DU_BACKEND" in os.environ else "mpirun"


def _first_set(*names, default=None):
    return next((os.environ[name] for name in names if name in os.environ), default)


def launched_rank() -> str:
    """This process's rank as the launcher set it (before any backend knows it), or "?"."""
    return _first_set("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", default="?")


def report_path():
    """Where this rank's watchdog also writes its report, or None."""
    folder = os.environ.get("DU_REPORT_DIR")
    return None if not folder else os.path.join(folder, f"rank-{launched_rank()}.report")


def expected_world_size():
    """The number of processes the launcher (du-launch, or mpirun) started, or None."""
    size = _first_set("DU_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    return None if size is None else int(size)


def job_id():
    return os.environ.get("DU_JOB_ID")


def launched_by_mpirun() -> bool:
    """Whether mpirun started this process in a job of more than one process."""
    return int(_first_set("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", default=1)) > 1


def launched_for(mlx_name: str) -> bool:
    """Whether a launcher started this process as a rank on MLX's ``mlx_name`` backend."""
    if mlx_name == "mpi":
        return launched_by_mpirun()
    return {"ring": "MLX_HOSTFILE", "nccl": "MLX_WORLD_SIZE", "jaccl": "MLX_IBV_DEVICES"}[
        mlx_name
    ] in os.environ


def check_ring_addresses():
    """Raise unless this rank can listen on its MLX_HOSTFILE addresses (MLX: "Couldn't bind socket")."""
    path = os.environ["MLX_HOSTFILE"]
    with open(path) as f:
        hosts = json.load(f)
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


# --- MPI -------------------------------------------------------------------------------


def libmpi_path():
    """The real shared library behind ``mpirun``, or None when there is no MPI."""
    name = "libmpi.dylib" if sys.platform == "darwin" else "libmpi.so.40"
    dirs = [Path(sys.prefix) / "lib"]
    mpirun = shutil.which("mpirun")
    if mpirun:
        dirs.append(Path(mpirun).resolve().parent.parent / "lib")
    for d in dirs:
        if (d / name).exists():
            return str(d / name)
    return None


def mlx_mpi_available() -> bool:
    """Whether MLX can load an MPI library. Points MLX_MPI_LIBNAME at the real libmpi first:
    MLX looks once, at the first question, and the wheel's ``libmpi.so`` is a linker script."""
    import mlx.core as mx

    if "MLX_MPI_LIBNAME" not in os.environ and libmpi_path() is not None:
        os.environ["MLX_MPI_LIBNAME"] = libmpi_path()
    return mx.distributed.is_available("mpi")


_mlx_mpi_started = False


def start_mlx_mpi():
    """Initialize MLX's MPI backend once, under ``mpirun``, before mpi4py: MLX's fails silently (a
    world of one) after mpi4py's MPI_Init, while mpi4py accepts MLX's. BackendUnavailableError
    when it cannot: no libmpi, or mpi4py was first."""
    global _mlx_mpi_started
    import mlx.core as mx

    if _mlx_mpi_started or not launched_by_mpirun():
        return
    if not mlx_mpi_available():
        named = os.environ.get("MLX_MPI_LIBNAME")
        why = (
            f"MLX_MPI_LIBNAME={named} did not load"
            if named
            else "none found; set MLX_MPI_LIBNAME to its libmpi"
        )
        raise BackendUnavailableError(f"MLX's MPI backend cannot load an MPI library: {why}")
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        raise BackendUnavailableError(
            "MLX's MPI backend cannot start after mpi4py initialized MPI in this process; "
            "initialize MLXMPIBackend or MPIBackend (which starts MLX's side first) before "
            "importing mpi4py.MPI yourself"
        )
    mx.distributed.init(strict=True, backend="mpi")
    _mlx_mpi_started = True
