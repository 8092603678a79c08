"""Horovod's module name: `import mpidp.torch as hvd` exposes exactly mpidp's public names."""

from mpidp import *  # noqa: F401,F403
from mpidp import __all__, __version__  # noqa: F401
