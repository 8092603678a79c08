"""mpidp's error types: every one says who, what, and how to fix it."""


class MpidpError(RuntimeError):
    """Root of mpidp's own errors."""


class ConfigError(MpidpError, ValueError):
    """A malformed MPIDP_*/HOROVOD_* value or an unknown knob."""


class NotInitializedError(MpidpError, ValueError):
    """mpidp was used before init() or after shutdown()."""


class ArgumentError(MpidpError, ValueError):
    """An argument Horovod refuses with RuntimeError, refused before enqueue; catchable as both.

    A ValueError, as mpidp's other argument errors, and a RuntimeError, as Horovod scripts
    catch it: reducescatter with a reduce op other than Average or Sum, a scalar to scatter,
    a grouped op whose tensors are on different kinds of device."""


class CollectiveError(MpidpError):
    """A collective failed on every rank: a cross-rank mismatch or an engine failure."""


class MismatchError(CollectiveError):
    """Ranks submitted incompatible requests under one name (dtype, shape, op, root...)."""


class EngineShutdownError(CollectiveError):
    """The engine stopped (shutdown, stall, internal failure) before the op completed."""


class OpTimeoutError(CollectiveError, TimeoutError):
    """synchronize(handle, timeout=...) ran out of time; the op is still pending."""


# Horovod's name for a failed collective; scripts catch it in their elastic loops.
HorovodInternalError = CollectiveError


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic driver raises it when hosts join or leave; an MPI job's world is fixed,
    so mpidp never does (scripts that catch it import it from mpidp.common.exceptions)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class CheckpointError(MpidpError):
    """Saving or loading a checkpoint failed; raised on every rank with rank 0's reason."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """load(): there is no checkpoint at the path (rank 0 looked); raised on every rank."""
