"""Where the MPI library is, and the one order in which MLX's MPI and mpi4py can share it.

MLX's MPI backend calls MPI_Init itself and fails (silently: a world of one) when
mpi4py initialized MPI first; mpi4py, on the other hand, accepts an MPI that is
already initialized. So whoever starts MPI in this process starts MLX's side first.
"""

import os
import shutil
import sys
from pathlib import Path


def launched_by_mpirun() -> bool:
    """Whether mpirun started this process in a job of more than one process."""
    return int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", 1))) > 1


def libmpi_path():
    """The real shared library behind ``mpirun`` (on Linux the pip wheel's ``libmpi.so``
    is a linker script that dlopen cannot load), or None when there is no MPI."""
    name = "libmpi.dylib" if sys.platform == "darwin" else "libmpi.so.40"
    dirs = [Path(sys.prefix) / "lib"]
    mpirun = shutil.which("mpirun")
    if mpirun:
        dirs.append(Path(mpirun).resolve().parent.parent / "lib")
    for d in dirs:
        if (d / name).exists():
            return str(d / name)
    return None


_mlx_mpi_started = False


def start_mlx_mpi():
    """Initialize MLX's MPI backend once, before mpi4py can; a no-op outside ``mpirun``.

    Raises BackendUnavailableError when that is impossible: no libmpi, or mpi4py was first.
    """
    global _mlx_mpi_started
    import mlx.core as mx

    from .base import BackendUnavailableError

    if _mlx_mpi_started or not launched_by_mpirun():
        return
    if "MLX_MPI_LIBNAME" not in os.environ:
        if libmpi_path() is None:
            raise BackendUnavailableError("MLX's MPI backend: no libmpi found; set MLX_MPI_LIBNAME")
        os.environ["MLX_MPI_LIBNAME"] = libmpi_path()
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized():
        raise BackendUnavailableError(
            "MLX's MPI backend cannot start after mpi4py initialized MPI in this process; "
            "initialize MLXMPIBackend or MPIBackend (which starts MLX's side first) before "
            "importing mpi4py.MPI yourself"
        )
    mx.distributed.init(strict=True, backend="mpi")
    _mlx_mpi_started = True
