"""The backends started in this process: ``initialize`` (once per backend class, checked against
what the launcher started) and the rank queries."""

import socket

from . import watchdog
from .backends import BY_LAUNCH_NAME, AbstractBackend, MLXBackend, RingBackend, contract
from .collectives import allgather, check_backend, check_count, run_collective

_BACKENDS = {}


def initialize(backend_type=None, *, timeout=None, debug=None, **kwargs) -> AbstractBackend:
    """Collective: start ``backend_type`` (``du.MPIBackend``, say; by default the one the launcher
    started, else a world of one) once; later calls return it. ``timeout`` (seconds; 0: never) and
    ``debug`` (check each collective across ranks first) set the watchdog's (``DU_TIMEOUT``, ``DU_DEBUG``)."""
    if backend_type is None:
        name = contract.launched_backend_name()
        if name is not None and name not in BY_LAUNCH_NAME:
            raise ValueError(f"DU_BACKEND={name!r} is not one of {sorted(BY_LAUNCH_NAME)}")
        backend_type = RingBackend if name is None else BY_LAUNCH_NAME[name]
    _check_backend_type(backend_type)
    watchdog.configure(timeout, debug)
    if backend_type not in _BACKENDS:
        with watchdog.connecting(f"initialize({backend_type.__name__})", contract.job_id() is not None):
            backend = backend_type(**kwargs)
            handshake(backend, contract.expected_world_size())
        _BACKENDS[backend_type] = backend
    return _BACKENDS[backend_type]


def split(backend, color: int):
    """Collective: a backend over the ranks that pass the same ``color`` (an int in [0, 2**31 - 1]), in
    ``backend``'s order (MPI's ``Comm.Split``, MLX's ``Group.split``; none on MLX's ring: BackendUnavailableError).
    Watched as any collective: a rank that never calls it ends the job within the timeout."""
    check_backend(backend)

    def split_group(_):  # (every rank's color first, checked on every rank: an int32, MPI's and MLX's)
        for rank, theirs in enumerate(allgather(backend, color)):
            check_count(theirs, 0, f"du.split: rank {rank}'s color", most=2**31 - 1)
        if backend.size == 1:
            return backend
        with watchdog.holding_the_gil():  # (MLX's MPI splits holding it)
            return backend.split(int(color))

    sub = run_collective(backend, "split", [], split_group)  # (no color shown: ranks pass their own)
    if sub is not backend:
        handshake(sub, parent=backend)  # (its node_rank, and its members: the job's ranks in it)
    return sub


def handshake(backend, expected=None, parent=None):
    """Collective: learn ``node_rank``; check the size (``expected``) and that every rank is of this job;
    a group of ``parent`` (``split``) learns its ``members``, the job's ranks in it."""
    if expected is not None and expected != backend.size:
        launcher = "du-launch" if contract.job_id() else "mpirun"
        raise contract.BackendUnavailableError(
            f"{type(backend).__name__}: {launcher} started {expected} processes but this backend "
            f"sees a world of {backend.size}; launch it with `du-launch --backend {backend.launch_name}`, or "
            f"initialize the backend this job was started for (du.initialize() with no argument: "
            f"{contract.launched_backend_name()})"
        )
    backend.job_rank = backend.rank if parent is None else parent.job_rank
    hosts, jobs, ranks = zip(*allgather(backend, (socket.gethostname(), contract.job_id(), backend.job_rank)))
    if len(set(jobs)) > 1:
        by_job = {job: [r for r, j in enumerate(jobs) if j == job] for job in dict.fromkeys(jobs)}
        raise RuntimeError(
            f"{type(backend).__name__}: rank {backend.rank} is connected to processes of another "
            f"job (ranks by job id: {by_job}); two jobs share a port"
        )
    backend.node_rank = hosts[: backend.rank].count(hosts[backend.rank])
    if parent is not None:
        backend.members = ranks


def initialized(backend_type) -> bool:
    """Whether ``initialize(backend_type)`` has run in this process."""
    _check_backend_type(backend_type)
    return backend_type in _BACKENDS


def get_distributed_backend(backend_type) -> AbstractBackend:
    """The backend object that ``initialize(backend_type)`` started."""
    if not initialized(backend_type):
        name = backend_type.__name__
        raise RuntimeError(f"{name} is not initialized: call du.initialize(du.{name}) first (on every rank)")
    return _BACKENDS[backend_type]


def local_rank(backend) -> int:
    """This process's rank in the whole job (Lux's ``local_rank``: 0 .. total_workers - 1)."""
    return check_backend(backend).rank


def total_workers(backend) -> int:
    """The number of processes in the job."""
    return check_backend(backend).size


def node_rank(backend) -> int:
    """This process's rank among the job's processes on the same host."""
    return check_backend(backend).node_rank


def _check_backend_type(backend_type):
    if not (isinstance(backend_type, type) and issubclass(backend_type, AbstractBackend)):
        names = ", du.".join(c.__name__ for c in BY_LAUNCH_NAME.values())
        instance = "the backend instance " if isinstance(backend_type, AbstractBackend) else ""
        raise TypeError(f"expected a backend class (one of du.{names}), got {instance}{backend_type!r}")
    if backend_type in (AbstractBackend, MLXBackend):
        raise TypeError(f"{backend_type.__name__} is abstract; use one of its subclasses")
