"""distributed_utils: Lux.jl's DistributedUtils for MLX. See README.md and docs/.

PYTEST_DONT_REWRITE (its pytest plugin loads it; it holds no tests to rewrite)"""

from .collectives import (
    CollectiveMismatchError,
    allgather,
    allreduce,
    avg,
    barrier,
    bcast,
    reduce,
    weighted_mean,
)
from .backends import (
    AbstractBackend,
    BackendUnavailableError,
    JACCLBackend,
    MLXBackend,
    MLXMPIBackend,
    MPIBackend,
    NCCLBackend,
    RingBackend,
)
from .checkpoint import CheckpointError, load_checkpoint, save_adapters, save_checkpoint
from .data import DistributedDataContainer
from .diloco import DiLoCo
from .fsdp import FullyShardedModule, clip_grad_norm, fully_shard
from .optimizer import DistributedOptimizer
from .preemption import preempted
from .reduction import reduce_gradients
from .sparse import SparseCodec
from .registry import (
    get_distributed_backend,
    initialize,
    initialized,
    local_rank,
    node_rank,
    split,
    total_workers,
)
from .synchronize import synchronize
from .tree import TreeMismatchError
from .watchdog import watch

__version__ = "0.1.0"
