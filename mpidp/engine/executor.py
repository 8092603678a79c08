"""Execution of one cycle's ordered responses: errors, joins, data-path batches, completions."""

import time
import traceback
from typing import Callable, List, Optional

from ..errors import EngineShutdownError, MismatchError
from ..log import logger
from . import fusion, mpi
from .messages import JOIN_NAME, OpType, Response
from .stats import BatchBytes
from .tensor_queue import Entry, OpState
from .timeline import Timeline


class Executor:
    """Runs every rank's identical response list in order on the engine's data path; the
    results are handed to their waiters all at once by release()."""

    def __init__(self, backend, stats, tuned, rank: int, size: int):
        self.backend = backend
        self.stats = stats
        self.tuned = tuned
        self.rank, self.size = rank, size
        self._batch_bytes = BatchBytes(fusion.nbytes)
        # The timeline's phase recorder last handed to the data path.
        self._mark: Optional[Callable[[str], None]] = None
        self._finished: list = []  # (entry, result, error) completed in this cycle

    def complete(self, entry: Optional[Entry], result=None, error=None) -> None:
        if entry is not None:
            self._finished.append((entry, result, error))

    def release(self, queue) -> None:
        """Wake the waiters of everything this cycle finished, all at once at its end: a waiter
        woken per op would fight the engine for the GIL through the rest of the cycle."""
        for entry, result, error in self._finished:
            queue.finished(entry)  # first, so the waiter may reuse the name at once
            if error is not None:
                entry.set_error(error)
            else:
                entry.set_result(result)
        self._finished = []

    def run(self, responses: List[Response], ops, neg, tl: Optional[Timeline]) -> None:
        """Execute `responses` for the ops in flight `ops` (by name). Synchronization: the
        batches' collectives with every rank of the engine."""
        data = []
        for resp in responses:
            entry = ops.get(resp.name)
            if resp.op == OpType.ERROR:
                self.complete(entry, error=MismatchError(resp.error))
            elif resp.op == OpType.JOIN:
                neg.joined = False
                neg.resend.update(
                    n for n in resp.pending if n not in ops or ops[n].state == OpState.NEW
                )
                self.complete(ops.get(JOIN_NAME), result=(resp.last_joined, resp.serial))
            elif entry is None and resp.op == OpType.BARRIER:
                continue  # this rank is joined: the others' barrier needs nothing from it
            elif entry is None and resp.op != OpType.ALLREDUCE:
                raise AssertionError(
                    f"response {resp.name!r} has no local entry on rank {self.rank}"
                )
            else:
                data.append(resp)
        if not data:
            return
        mark = None if tl is None else tl.mark
        if mark != self._mark:
            # The data path reports its phases (pack, mpi) through this while a timeline records.
            self.backend.timeline_mark = self._mark = mark
        tuned = self.tuned
        # One op alone (a blocking call's) is its own batch: plan() would find the same.
        batches = (
            [data]
            if len(data) == 1
            else fusion.plan(data, tuned.fuse_below_bytes, tuned.fusion_threshold_bytes)
        )
        for batch in batches:
            self._batch(batch, [ops.get(r.name) for r in batch], tl)

    def run_lone(self, resp: Response, entry: Entry, queue, lane) -> None:
        """run([resp]) and release() for an allreduce of one tensor, in flight alone, by its
        `lane` (lane.Lane, which has a data path): nothing to sort, plan or hand over in bulk.
        Synchronization: the allreduce with every rank of the engine."""
        try:
            lane.run(entry.tensor[0], entry.output[0], self.stats)
        except Exception as exc:
            self._failed([resp], [entry], exc)
            self.release(queue)
            return
        queue.finished(entry)  # first, so the waiter may reuse the name at once
        entry.set_result(entry.output)

    def _batch(self, batch: List[Response], entries: List[Optional[Entry]], tl) -> None:
        op = batch[0].op
        nbytes = 0 if op == OpType.BARRIER else self._batch_bytes(batch)
        began = time.monotonic()
        self.stats.begin_batch(began)
        tuned = self.tuned
        entry = entries[0]
        try:
            results = None
            if (
                op == OpType.ALLREDUCE
                and entry is not None
                and len(entry.tensor) == 1
                and len(batch) == 1
            ):
                one = self.backend.allreduce_one(entry)
                results = None if one is None else [one]
            if results is None:
                results = self.backend.execute(
                    batch, entries, tuned.fuse_below_bytes, tuned.fusion_threshold_bytes
                )
        except Exception as exc:
            self._failed(batch, entries, exc)
            return
        ended = time.monotonic()
        self.stats.batch(op, fusion.tensor_count(batch), nbytes, ended - began)
        if tl is not None:
            tl.batch_end(batch, began, ended, nbytes)
        for entry, result in zip(entries, results):
            self.complete(entry, result=result)

    def _failed(self, batch: List[Response], entries: List[Optional[Entry]], exc) -> None:
        """The data path raised `exc` in `batch`: end the job when peers may be inside its
        collective, else fail the batch's ops."""
        if self.size > 1:
            # The peers may be inside this batch's collective, which this rank will never
            # enter or finish: failing the op here alone would leave them waiting forever
            # (whatever abort_on_error says), so the job ends.
            mpi.abort_job(
                f"{batch[0].name!r}: the data path failed on rank {self.rank} "
                f"with {type(exc).__name__}: {exc}; the other ranks of this "
                f"collective cannot finish it, so every rank of the job is "
                f"ended:\n{traceback.format_exc().rstrip()}"
            )
        logger.error("%s failed:\n%s", batch[0].name, traceback.format_exc())
        for entry in entries:  # alone, a bad buffer fails its ops, not the engine
            self.complete(
                entry,
                error=EngineShutdownError(
                    f"{batch[0].name!r}: data path failed on rank {self.rank}: {exc}"
                ),
            )
