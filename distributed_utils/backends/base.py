"""The primitives every transport implements; everything above ``backends/`` reaches them
only through ``collectives.py``, which check, watch and evaluate."""

import abc
import functools

import mlx.core as mx


class BackendUnavailableError(RuntimeError):
    """The transport behind a backend cannot run on this machine or in this process."""


class AbstractBackend(abc.ABC):
    """A fixed group of processes that run the same collectives in the same order. Subclasses
    set ``rank`` and ``size`` and implement the primitives: on ``mx.array``s of the same shapes
    and dtypes on every rank (for ``allreduce``: no bools, and numpy too with ``host_buffers``),
    evaluated, except while MLX traces a function (``mx.compile``)."""

    rank: int
    size: int
    #: The launcher's name for this backend (``DU_BACKEND``; ``du-launch --backend NAME`` if it starts it).
    launch_name: str = ""
    started_by_du_launch: bool = False
    #: This process's rank among the processes on its host; set by ``initialize``.
    node_rank: int = 0
    #: The job's ranks in this group (``du.split``'s), or None for the whole job; this process's rank in the
    #: job; the number of the last collective on it (each group numbers its own: groups make their own).
    members, job_rank, seq = None, 0, 0
    #: Gradients smaller than this are packed into buckets of this many bytes, one collective
    #: each; larger ones travel alone, as they are (mlx.nn.average_gradients packs 32 MiB too).
    bucket_bytes: int = 32 * 2**20
    #: Whether ``reduce_scatter`` is the transport's own (half an all-reduce's traffic).
    native_reduce_scatter: bool = False
    #: Whether ``allreduce`` also takes numpy arrays, and gives numpy ones back for them (a
    #: transport on host memory: numbers and numpy arrays then never become MLX arrays).
    host_buffers: bool = False

    @functools.cached_property
    def fully_sharded_units(self) -> list:
        """Class names of the units ``du.fully_shard`` made over this backend; a unit's number: its place."""
        return []

    @abc.abstractmethod
    def allreduce(self, arrays: list, op: str, scale: float = 1.0, in_place: bool = False) -> list:
        """Each array reduced over all ranks by ``op`` ("sum", "max", "min", "prod"); sums (floating) times
        ``scale``, before or after. ``in_place``: the arrays are handed over; results may go into them."""

    @abc.abstractmethod
    def bcast(self, x, root: int):
        """Root's ``x``, bit for bit, on every rank."""

    @abc.abstractmethod
    def allgather(self, x):
        """Every rank's ``x`` (at least 1-d) concatenated along the first axis, in rank order."""

    @abc.abstractmethod
    def barrier(self):
        """Returns on each rank once every rank has called it."""

    def start_sum(self, arrays: list, scale: float = 1.0, in_place: bool = False):
        """``collectives.start_sum``'s primitive (its order of travel and ``in_place`` as there): returns the
        function that waits for the sums and gives them. Here: ``allreduce``, now."""
        out = self.allreduce(arrays, "sum", scale, in_place)
        return lambda: out

    def reduce_scatter(self, x, scale: float = 1.0):
        """Rank r's part ``r * c .. (r + 1) * c - 1`` of the sum of every rank's 1-d ``x`` times
        ``scale`` (c = length / size). Here: the whole sum, then the part (a native one sets
        ``native_reduce_scatter``)."""
        c = x.shape[0] // self.size
        return mx.contiguous(self.allreduce([x], "sum", scale)[0][self.rank * c : (self.rank + 1) * c])

    def split(self, color: int) -> "AbstractBackend":  # (du.split's primitive: its docstring)
        raise BackendUnavailableError(f"{type(self).__name__} cannot split into groups")

    def __repr__(self):
        return f"{type(self).__name__}(rank={self.rank}, size={self.size})"
