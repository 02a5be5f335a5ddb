"""One module per transport, each implementing the AbstractBackend primitives; and the
contract between the launcher and its ranks (``contract``)."""

from .base import AbstractBackend, BackendUnavailableError
from .mlx import JACCLBackend, MLXBackend, MLXMPIBackend, NCCLBackend, RingBackend
from .mpi import MPIBackend

#: The backends by their launch name (``DU_BACKEND``; ``du-launch --backend`` starts some of them).
BY_LAUNCH_NAME = {
    cls.launch_name: cls for cls in (MPIBackend, RingBackend, MLXMPIBackend, NCCLBackend, JACCLBackend)
}
