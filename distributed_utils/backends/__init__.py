"""One module per transport, each implementing the AbstractBackend primitives; and the
contract between the launcher and the backends (``environment``)."""

from .base import OPS, AbstractBackend, BackendUnavailableError
from .mlx import JACCLBackend, MLXBackend, MLXMPIBackend, NCCLBackend, RingBackend
from .mpi import MPIBackend

#: The backends by the name ``du-launch --backend`` takes.
BY_LAUNCH_NAME = {
    cls.launch_name: cls for cls in (MPIBackend, RingBackend, MLXMPIBackend, NCCLBackend, JACCLBackend)
}
