"""Horovod's `horovod.common.exceptions`: the exceptions elastic scripts catch."""

from mpidp.errors import HorovodInternalError, HostsUpdatedInterrupt

__all__ = ["HorovodInternalError", "HostsUpdatedInterrupt"]
