"""torch.distributed's backend on mpidp's engine, registered by `import mpidp.distributed`.

Then `dist.init_process_group("mpidp")` under mpiexec or srun (docs/torch_distributed.md).
"""

from .group import ProcessGroupMpidp
from .registration import install, torch_has_mpi

install()

__all__ = ["ProcessGroupMpidp", "install", "torch_has_mpi"]
