"""Horovod's module name: `import mpidp.torch as hvd` exposes exactly mpidp's public names.

A package, so that the submodules Horovod scripts import (`horovod.torch.elastic`,
`.mpi_ops`, `.compression`, `.optimizer`, `.sync_batch_norm`, `.functions`) exist under the same
names; each re-exports from the module where the code lives.
"""

from mpidp import *  # noqa: F401,F403
from mpidp import __all__, __version__  # noqa: F401

# After the star import, so that these names are the submodules below (which hold the same
# objects) rather than mpidp's modules of the same names.
from . import compression, elastic, functions, mpi_ops, optimizer, sync_batch_norm  # noqa: E402,F401
