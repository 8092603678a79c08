"""Checkpoints that lose nothing: rank-0 atomic save, load broadcast from rank 0, per-rank RNG.

`save(path, **state)` stores named values: a `torch.nn.Module` as its `state_dict()`, anything
else with `state_dict()` and `load_state_dict()` (optimizers, `DistributedOptimizer`, LR
schedulers, `mpidp.elastic.ElasticSampler`) as its state, a sampler with `set_epoch()` and no
state_dict (torch's `DistributedSampler`) as its epoch, other values as they are. Values must be
of types `torch.load(weights_only=True)` accepts (tensors, numbers, strings, bytes, None, lists,
tuples, dicts, `torch.Size`, dtypes); `save` refuses anything else up front, so a checkpoint that
could not be loaded is never written. It also stores the random number generator states of every
rank: torch's CPU generator, numpy's global generator, Python's `random`, and CUDA's generators
where CUDA is available. `load(path, **targets)` puts the saved states into the targets passed by
name, restores this rank's own RNG states and returns the other values. A ShardedOptimizer is
saved consolidated (gathered on rank 0) by `save`, and as one file per rank by `save_sharded`
(checkpoint_shards.py); `load` takes either, at any world size.

Atomicity: rank 0 writes a temporary file `.<name>.tmp-<pid>` in the checkpoint's directory,
flushes and fsyncs it, renames it over `path` (`os.replace`) and fsyncs the directory. A process
killed at any moment leaves either the previous checkpoint or the new one, never a torn file.
A kill before the rename leaves a temporary file behind; the next `save` to the same path removes
every `.<name>.tmp-*`, so at most one stale temporary exists per checkpoint. One job saves to a
given path at a time. `load` checks every part of the file against the CRC-32 its archive stores
(torch.load does not), so a damaged copy fails on every rank, naming the file, instead of loading
wrong numbers.
"""

import collections
import errno
import io
import os
import zipfile
from typing import Any, Dict, List, Optional

import torch

from .. import ops
from ..errors import CheckpointError, CheckpointNotFoundError
from ..log import logger
from ..ops import functions
from ..runtime import world
from . import checkpoint_shards
from .rng import rng_state, set_rng_state

FORMAT = "mpidp.checkpoint/1"
RESERVED = ("restore_rng",)  # load() options; save() refuses them as names

_VALUE, _MODULE, _STATEFUL, _EPOCH = "value", "module", "stateful", "epoch"
_PLAIN = (str, bytes, int, float, bool, complex, type(None), torch.dtype, torch.device, torch.Size)


# ---- save ----


def _kind(value) -> str:
    if isinstance(value, torch.nn.Module):
        return _MODULE
    if callable(getattr(value, "state_dict", None)) and callable(
        getattr(value, "load_state_dict", None)
    ):
        return _STATEFUL
    if callable(getattr(value, "set_epoch", None)) and type(getattr(value, "epoch", None)) is int:
        return _EPOCH  # torch's DistributedSampler: its shuffle depends on the epoch alone
    return _VALUE


def _check_loadable(value, where: str) -> None:
    """TypeError naming the first part of `value` that torch.load(weights_only=True) refuses.

    Exact types, not isinstance: subclasses (numpy.float64, namedtuples, defaultdict) are refused
    by a weights-only load even though their bases are accepted.
    """
    kind = type(value)
    if isinstance(value, torch.Tensor) or kind in _PLAIN:
        return
    if kind in (list, tuple, set):
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]")
        return
    if kind in (dict, collections.OrderedDict):
        for key, item in value.items():
            _check_loadable(key, f"{where} key {key!r}")
            _check_loadable(item, f"{where}[{key!r}]")
        return
    hint = (
        " (an object is stored through its state_dict() and load_state_dict(), or as its "
        "epoch if it has set_epoch() and an int epoch; this one has neither)"
        if hasattr(value, "__dict__")
        else ""
    )
    raise TypeError(
        f"{where} is a {kind.__module__}.{kind.__qualname__}, which "
        f"torch.load(weights_only=True) refuses{hint}; store tensors, numbers, "
        f"strings, lists, tuples or dicts (for example x.tolist() or "
        f"torch.from_numpy(x))"
    )


def _payload(state: Dict[str, Any], rngs: List[Dict[str, Any]]) -> Dict[str, Any]:
    kinds, values = {}, {}
    for key, value in state.items():
        kinds[key] = kind = _kind(value)
        values[key] = (
            value
            if kind == _VALUE
            else {"epoch": value.epoch}
            if kind == _EPOCH
            else value.state_dict()
        )
        _check_loadable(values[key], f"checkpoint value {key!r}")
    return {"format": FORMAT, "world_size": len(rngs), "kinds": kinds, "state": values, "rng": rngs}


def _remove_stale_temporaries(directory: str, base: str) -> None:
    prefix = f".{base}.tmp-"
    for entry in os.listdir(directory):
        if entry.startswith(prefix):
            try:
                os.unlink(os.path.join(directory, entry))
            except FileNotFoundError:
                pass


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some file systems cannot fsync a directory; the rename is still atomic there.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _write_atomically(path: str, payload: Dict[str, Any]) -> None:
    directory, base = os.path.split(os.path.abspath(path))
    if not os.path.isdir(directory):
        raise FileNotFoundError(
            errno.ENOENT, "the checkpoint's directory does not exist", directory
        )
    _remove_stale_temporaries(directory, base)
    tmp = os.path.join(directory, f".{base}.tmp-{os.getpid()}")
    # os.open rather than tempfile: the checkpoint gets the umask's permissions, like torch.save.
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_directory(directory)


def _describe(exc: BaseException) -> str:
    """The failure in words; torch.save reports a failed write as an opaque RuntimeError, with
    the OSError (ENOSPC, EFBIG, EIO...) that caused it only in the exception's context."""
    text = f"{type(exc).__name__}: {exc}"
    cause: Optional[BaseException] = exc
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None and cause is not exc:
        text = f"{type(cause).__name__}: {cause} (torch.save said: {text})"
    return text


def save(path, /, **state) -> None:
    """Save `state` (named values) to `path` atomically; rank 0 writes, every rank must call it.

    Modules are stored as their `state_dict()`, objects with `state_dict()`/`load_state_dict()`
    (optimizers, samplers, schedulers) as their state, a sampler with only `set_epoch()` (torch's
    `DistributedSampler`) as its epoch, other values as they are; every rank's RNG
    states are stored too. Only rank 0's values are written: the ranks are assumed to hold
    replicas. Synchronization: an allgather of the RNG states, then every rank waits until rank 0
    has renamed the file into place and fsynced the directory (one broadcast of the outcome). If
    rank 0 fails (bad directory, disk full, a value a weights-only load would refuse), every rank
    raises CheckpointError with rank 0's reason, and the previous checkpoint at `path` is intact.
    """
    path = os.fspath(path)
    bad = sorted(set(state) & set(RESERVED))
    if bad:
        raise ValueError(f"checkpoint.save: {bad} are load() options and cannot name a value")
    for value in state.values():
        if getattr(value, "is_sharded", False):  # a ShardedOptimizer: its state on rank 0
            value.consolidate_state_dict(to=0)
    rngs = functions.allgather_object(rng_state(), name="mpidp.checkpoint.save.rng")
    failure = None
    if world.rank() == 0:
        try:
            _write_atomically(path, _payload(state, rngs))
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            failure = _describe(exc)
            logger.error("checkpoint.save(%r) failed: %s", path, failure)
    failure = functions.broadcast_object(failure, 0, name="mpidp.checkpoint.save.outcome")
    if failure is not None:
        raise CheckpointError(
            f"checkpoint.save({path!r}) failed on rank 0: {failure}; the "
            f"previous checkpoint there, if any, is unchanged"
        )
    logger.debug("checkpoint saved to %s", path)


def save_sharded(path, /, **state) -> None:
    """As save(), but each ShardedOptimizer is stored as every rank's own shard, written by
    that rank next to `path` (checkpoint_shards.py): nothing is gathered. load() reads it back at
    any world size. Synchronization: as save(), plus an allgather of the shard writes' outcome."""
    path = os.fspath(path)
    save(path, **{**state, **checkpoint_shards.write(path, state, _write_atomically, _describe)})


# ---- load ----


def _damaged_member(data: bytearray):
    """The first part of a checkpoint whose bytes fail the CRC-32 its zip archive stores, or None:
    torch.load does not check them, and would load damaged tensor data as it is."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return archive.testzip()
    except zipfile.BadZipFile:
        return None  # not an archive at all: torch.load says what is wrong with it


def _read_on_rank0(path: str):
    """(error kind, message, file contents as a uint8 tensor): only rank 0 touches the file."""
    empty = torch.empty(0, dtype=torch.uint8)
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
        if got != len(data):
            return "error", f"{path!r} changed size while rank 0 read it", empty
        damaged = _damaged_member(data)
        if damaged:
            return (
                "error",
                (
                    f"{path!r} is damaged: its part {damaged!r} fails its CRC-32 check "
                    f"(a torn copy or a disk fault); load an earlier checkpoint or start "
                    f"over"
                ),
                empty,
            )
        return None, None, torch.frombuffer(data, dtype=torch.uint8) if data else empty
    except FileNotFoundError:
        return "missing", f"no checkpoint at {path!r} (as seen by rank 0)", empty
    except OSError as exc:
        return "error", f"rank 0 could not read {path!r}: {type(exc).__name__}: {exc}", empty


def _broadcast_file(path: str):
    """Rank 0's (error kind, message, contents) on every rank. The contents travel as a tensor,
    not pickled: about half of broadcast_object's time for 100 MiB here (BENCHMARKS.md)."""
    read = _read_on_rank0(path) if world.rank() == 0 else (None, None, None)
    header = (read[0], read[1], read[2].numel()) if read[2] is not None else None
    kind, message, length = functions.broadcast_object(
        header, 0, name="mpidp.checkpoint.load.header"
    )
    data = read[2] if world.rank() == 0 else torch.empty(length, dtype=torch.uint8)
    if length:
        ops.synchronize(ops.broadcast_async_(data, 0, name="mpidp.checkpoint.load.file"))
    return kind, message, data


def _parse(path: str, data: torch.Tensor) -> Dict[str, Any]:
    buffer = io.BytesIO(data.numpy())  # type: ignore[arg-type]  # numpy's stubs omit __buffer__
    payload = torch.load(buffer, map_location="cpu", weights_only=True)
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise CheckpointError(f"{path!r} is not an mpidp checkpoint (format {FORMAT})")
    return payload


def _apply(path: str, payload: Dict[str, Any], targets: Dict[str, Any]) -> Dict[str, Any]:
    state, kinds = payload["state"], payload["kinds"]
    missing = sorted(set(targets) - set(state))
    if missing:
        raise CheckpointError(f"{path!r} holds no {missing}; it holds {sorted(state)}")
    for key, target in targets.items():
        if kinds[key] == _EPOCH and callable(getattr(target, "set_epoch", None)):
            target.set_epoch(state[key]["epoch"])
            continue
        if not callable(getattr(target, "load_state_dict", None)):
            raise TypeError(
                f"checkpoint.load: target {key!r} is a {type(target).__name__} "
                f"without load_state_dict(); leave it out to get the value back"
            )
        if kinds[key] == _VALUE:
            raise TypeError(
                f"checkpoint.load: {key!r} was saved as a plain value, not as the "
                f"state of a module, optimizer or sampler"
            )
        target.load_state_dict(checkpoint_shards.resolve(path, key, state[key], target))
    return {key: value for key, value in state.items() if key not in targets}


def load(path, /, *, restore_rng: bool = True, **targets) -> Dict[str, Any]:
    """Load the checkpoint at `path` on every rank; return the values not passed as targets.

    Rank 0 reads the file and broadcasts its bytes; every rank parses them with
    `torch.load(weights_only=True)`. Each target (a module, optimizer, sampler..., passed under the
    name it was saved with) gets its saved state through `load_state_dict` (a DistributedSampler
    its epoch through `set_epoch`). With `restore_rng`,
    each rank gets back its own RNG states from the save; if the checkpoint was saved by a
    different number of ranks, RNG states are left alone (rank 0 logs a warning saying so) and the
    rest loads. Synchronization: a broadcast of the file, then an allgather of every rank's
    outcome: a missing file raises CheckpointNotFoundError, any other failure on any rank
    CheckpointError, on every rank (targets loaded before a failing one keep their new state).
    Memory: while loading, each rank briefly holds a few copies of the file's bytes.
    """
    path = os.fspath(path)
    rank = world.rank()
    kind, message, data = _broadcast_file(path)
    if kind == "missing":
        raise CheckpointNotFoundError(message)
    if kind is not None:
        raise CheckpointError(message)
    rest, failure = None, None
    try:
        payload = _parse(path, data)
        del data
        rest = _apply(path, payload, targets)
        if restore_rng and payload["world_size"] == world.size():
            set_rng_state(payload["rng"][rank])
        elif restore_rng and rank == 0:
            logger.warning(
                "checkpoint %s was saved by %d ranks and is loaded by %d: RNG states "
                "are not restored, so this run will not repeat the saved one "
                "bitwise",
                path,
                payload["world_size"],
                world.size(),
            )
    except Exception as exc:  # noqa: BLE001 - every rank must learn of every rank's failure
        failure = f"{type(exc).__name__}: {exc}"
    failures = functions.allgather_object(failure, name="mpidp.checkpoint.load.outcome")
    bad = [(r, f) for r, f in enumerate(failures) if f is not None]
    if bad:
        raise CheckpointError(
            f"checkpoint.load({path!r}) failed: " + "; ".join(f"rank {r}: {f}" for r, f in bad)
        )
    assert rest is not None  # no rank failed, this one included
    return rest
