"""Elastic-style training state on MPI: commit, restore and sync state; resume after a restart.

With MPI the world cannot shrink or grow while a job runs: a rank that fails ends the job. So
where Horovod's elastic mode catches the failure and carries on with the survivors, mpidp's
`run` resumes from the last *persisted* commit when the job is started again (a Slurm requeue,
a batch script that loops, a user re-running the command). Inside a job, `commit()`, `restore()`
and `sync()` behave as in Horovod, and `run` does not catch errors: a collective that fails
(HorovodInternalError) propagates and ends the job.

Persisting: a state persists each `commit()` with `mpidp.checkpoint.save` when it has a checkpoint
path: the `checkpoint_path=` argument of its constructor, else the knob MPIDP_ELASTIC_CHECKPOINT;
empty means in-memory commits only. Rank 0's path is the one used (broadcast once, on the first
commit or resume). A persisted commit also holds every rank's RNG states, so a resumed run
repeats the uninterrupted one bitwise (same world size, deterministic ops); in-memory
`restore()` leaves RNG states alone, as Horovod does.

`ElasticSampler` (elastic_sampler.py) shards a data set and records how far the epoch has got,
so a resumed run continues mid-epoch.
"""

import abc
import copy
import functools
from typing import Any, Callable, Dict, List, Optional

import torch

from ..log import logger
from ..ops import functions
from ..runtime import world
from . import checkpoint
from .elastic_sampler import ElasticSampler  # noqa: F401 (mpidp.elastic.ElasticSampler)


class State(abc.ABC):
    """Training state that can be committed, restored to the last commit and synced from rank 0.

    Subclasses implement `save()` (take the in-memory copy), `restore()`, `sync()` and
    `_persisted()`/`_load_persisted()` (what goes to and comes from the checkpoint file).
    """

    def __init__(self, checkpoint_path: Optional[str] = None):
        self._checkpoint_arg = checkpoint_path
        self._checkpoint_path: Optional[str] = None  # rank 0's, once agreed
        self._reset_callbacks: List[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: List[Callable[[], None]]) -> None:
        """Call `callbacks` (no arguments) after `run` resumes a restarted job from a commit."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run the reset callbacks (done by `run` after resuming from a persisted commit)."""
        for callback in self._reset_callbacks:
            callback()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here when its driver announces hosts joining or
        leaving. An MPI job's hosts never change while it runs (see the module doc), so there
        is never anything to raise. Synchronization: none."""

    def checkpoint_path(self) -> str:
        """Rank 0's checkpoint path ('' for none). Collective the first time: a broadcast."""
        if self._checkpoint_path is None:
            mine = self._checkpoint_arg
            if mine is None:
                mine = world.state().config.elastic_checkpoint
            self._checkpoint_path = functions.broadcast_object(
                str(mine), 0, name="mpidp.elastic.checkpoint_path"
            )
        return self._checkpoint_path

    def commit(self) -> None:
        """Take the in-memory copy that `restore()` returns to, and persist it if a checkpoint path
        is set. Synchronization: none in memory; a persisted commit is a `checkpoint.save` (an
        allgather, then every rank waits for rank 0's write)."""
        self.save()
        path = self.checkpoint_path()
        if path:
            checkpoint.save(path, **self._persisted())

    def resume(self) -> bool:
        """Load the persisted commit if one exists; True if it did. Collective (see
        `checkpoint.load`); done by `run` at start."""
        path = self.checkpoint_path()
        if not path:
            return False
        try:
            self._load_persisted(path)
        except checkpoint.CheckpointNotFoundError:
            return False
        self.save()
        logger.info("elastic: resumed from the commit in %s", path)
        return True

    @abc.abstractmethod
    def save(self) -> None:
        """Take the in-memory copy of the state."""

    @abc.abstractmethod
    def restore(self) -> None:
        """Return to the in-memory copy."""

    @abc.abstractmethod
    def sync(self) -> None:
        """Make every rank's state rank 0's (collective)."""

    @abc.abstractmethod
    def _persisted(self) -> Dict[str, Any]:
        """The named values `commit()` hands to checkpoint.save."""

    @abc.abstractmethod
    def _load_persisted(self, path: str) -> None:
        """Load the checkpoint at `path` into the state (collective)."""


class ObjectState(State):
    """Named values kept as attributes (`state.epoch`, `state.batch`...), committed by deep copy.

    Values persisted to a checkpoint must be types a weights-only load accepts (numbers,
    strings, tensors, lists, tuples, dicts); `sync()` broadcasts rank 0's values.
    """

    def __init__(self, checkpoint_path: Optional[str] = None, **kwargs):
        super().__init__(checkpoint_path)
        _check_names(self, kwargs)
        self._names = list(kwargs)
        for name, value in kwargs.items():
            setattr(self, name, value)
        self._saved: Dict[str, Any] = {}
        ObjectState.save(self)

    def _values(self) -> Dict[str, Any]:
        return {name: getattr(self, name) for name in self._names}

    def save(self) -> None:
        """Keep a deep copy of every value. No synchronization."""
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        """Set every value back to the last commit. No synchronization."""
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self) -> None:
        """Make every value rank 0's, and commit that in memory. Synchronization: a broadcast."""
        values = functions.broadcast_object(self._values(), 0, name="mpidp.elastic.objects")
        for name, value in values.items():
            setattr(self, name, value)
        ObjectState.save(self)

    def _persisted(self) -> Dict[str, Any]:
        return self._values()

    def _load_persisted(self, path: str) -> None:
        values = checkpoint.load(path)
        for name in self._names:
            if name in values:
                setattr(self, name, values[name])


class TorchState(ObjectState):
    """A model, an optimizer and named values; values with `state_dict()`/`load_state_dict()`
    (samplers such as `ElasticSampler`, LR schedulers) are committed through their state.

    `checkpoint_path` (keyword) persists commits there (see the module docstring).
    """

    def __init__(
        self,
        model: Optional[torch.nn.Module] = None,
        optimizer=None,
        checkpoint_path: Optional[str] = None,
        **kwargs,
    ):
        _check_names(self, kwargs)
        self.model = model
        self.optimizer = optimizer
        self._stateful = {name: value for name, value in kwargs.items() if _stateful(value)}
        self._saved_states: Dict[str, Any] = {}
        plain = {name: value for name, value in kwargs.items() if name not in self._stateful}
        for name, value in self._stateful.items():
            setattr(self, name, value)
        super().__init__(checkpoint_path, **plain)
        TorchState.save(self)

    def _objects(self) -> Dict[str, Any]:
        objects = dict(self._stateful)
        if self.model is not None:
            objects["model"] = self.model
        if self.optimizer is not None:
            objects["optimizer"] = self.optimizer
        return objects

    def save(self) -> None:
        """Keep copies of the model's, optimizer's and samplers' states and of the values."""
        super().save()
        self._saved_states = {
            name: copy.deepcopy(obj.state_dict()) for name, obj in self._objects().items()
        }

    def restore(self) -> None:
        """Put the last commit back into the model, optimizer, samplers and values."""
        super().restore()
        for name, obj in self._objects().items():
            # A copy: optimizers keep the tensors they are given, and later steps would
            # change the commit in place.
            obj.load_state_dict(copy.deepcopy(self._saved_states[name]))

    def sync(self) -> None:
        """Make everything rank 0's and commit that in memory. Synchronization: broadcasts of
        the parameters and buffers, the optimizer state and the other states and values."""
        if self.model is not None:
            functions.broadcast_parameters(self.model.state_dict(), 0)
        if self.optimizer is not None:
            functions.broadcast_optimizer_state(self.optimizer, 0, model=self.model)
        states = functions.broadcast_object(
            {name: obj.state_dict() for name, obj in self._stateful.items()},
            0,
            name="mpidp.elastic.states",
        )
        for name, value in states.items():
            self._stateful[name].load_state_dict(value)
        super().sync()
        TorchState.save(self)

    def _persisted(self) -> Dict[str, Any]:
        return {**self._values(), **self._objects()}

    def _load_persisted(self, path: str) -> None:
        values = checkpoint.load(path, **self._objects())
        for name in self._names:
            if name in values:
                setattr(self, name, values[name])


def _check_names(state: State, kwargs: Dict[str, Any]) -> None:
    own = ("model", "optimizer")
    taken = [
        name for name in kwargs if name.startswith("_") or name in own or hasattr(type(state), name)
    ]
    if taken:
        raise ValueError(
            f"{type(state).__name__}: the names {taken} are its own attributes or "
            f"methods; choose other names"
        )


def _stateful(value) -> bool:
    return (
        not isinstance(value, torch.nn.Module)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate `func(state, *args, **kwargs)`: resume, sync, then call it.

    The wrapper loads the persisted commit if one exists (a restarted job), broadcasts rank 0's
    state to every rank (`state.sync()`), runs the reset callbacks if it resumed, then calls
    `func`. Errors are not caught (see the module docstring). Synchronization: the collectives
    of `state.resume()` and `state.sync()`.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        resumed = state.resume()
        state.sync()
        if resumed:
            state.on_reset()
        return func(state, *args, **kwargs)

    return wrapper
