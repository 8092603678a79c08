"""The engine: sleeps until work arrives, then runs negotiation cycles and executes the ready."""

import contextlib
import threading
import time
import traceback
from typing import List, Optional

from ..errors import EngineShutdownError, MismatchError
from ..log import logger
from . import autotune, fusion, mpi, timeline
from .backends import make_backend
from .messages import JOIN_NAME, OpType, Response
from .protocol import WAKE_POLL_S, Negotiator
from .stats import BatchBytes, EngineStats
from .tensor_queue import Entry, TensorQueue
from .timeline import Timeline

# Longest sleep between cycles that made no progress while this rank has ops waiting for other
# ranks: bounds the delay a late peer sees without spinning through a backward pass.
_WAITING_BACKOFF_MAX_S = 1e-3


class Engine:
    """One per process set; all of its MPI calls are made under its cycle lock, by its own
    thread or by a user thread that drives an idle engine through a blocking call."""

    def __init__(self, comms, config, set_id: int = 0):
        self.comms = comms
        self.set_id = set_id  # process set this engine serves (0: the global set)
        self.config = config
        self.rank, self.size = comms.rank, comms.size
        self.queue = TensorQueue()
        self.stats = EngineStats()
        self.neg = Negotiator(comms, config, self.stats)
        self.backend = make_backend(comms, config)
        self.backend.busy = self._user_waits
        self.backend.stats = self.stats
        self._batch_bytes = BatchBytes(fusion.nbytes)
        self.tuned = autotune.Tuned(config)
        self.switches = self.tuned.switches
        self.sampler = autotune.Sampler(config, self.params()) \
            if config.autotune and self.rank == 0 else None
        self._tune = None  # parameters rank 0 sends at the next coordinator cycle
        # Rank 0 of the global set only; swapped by start/stop_timeline.
        self.timeline: Optional[Timeline] = timeline.from_start(config, set_id, self.rank)
        self._waiters_lock = threading.Lock()
        self.waiters = 0  # user threads blocked on a result: the band may then spin for peers
        self._lock = threading.Lock()  # the cycle lock: whoever holds it may call MPI
        self._spin = False
        self._finished: list = []  # (entry, result, error) completed in this cycle
        self._stop = False
        self._reason: Optional[BaseException] = None  # why the engine stopped, once it has
        self._clean = True
        self._thread = threading.Thread(target=self._run, name="mpidp-engine", daemon=True)

    # ---- user-thread side ----

    def start(self) -> None:
        self._thread.start()

    def submit(self, entries: List[Entry], notify: bool = True) -> None:
        """Enqueue; raises the engine's stop reason if it has stopped. `notify=False` leaves
        the engine thread asleep: the caller will drive() the engine itself."""
        self.queue.push(entries, notify)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Ask every rank's engine to stop at the next cycle; True once this thread has ended."""
        self._stop = True
        self.queue.notify()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def params(self) -> dict:
        """The autotunable knobs' current values on this rank."""
        return self.tuned.values()

    @contextlib.contextmanager
    def user_waiting(self):
        """Marks a user thread as blocked on a result (the band may then spin for peers)."""
        with self._waiters_lock:
            self.waiters += 1
        try:
            yield
        finally:
            with self._waiters_lock:
                self.waiters -= 1

    def drive(self, entries: List[Entry]) -> None:
        """If no thread is running the engine, run its cycles on this thread until `entries`
        are complete; otherwise make sure the engine thread is awake, and return.

        A blocking op driven this way costs no hand-off to the engine thread and back, which
        here costs more than the op itself. Synchronization: the cycles' collectives with every
        rank of the engine.
        """
        if all(e.done() for e in entries):
            return
        if not self._lock.acquire(blocking=False):
            self.queue.notify()  # it may have been told of nothing (submit(notify=False))
            return
        try:
            self._spin = True
            while self._reason is None and not all(e.done() for e in entries):
                if not self._guarded_cycle():
                    self._back_off()
        finally:
            self._spin = False
            self._lock.release()
            if self.queue.ops or self._reason is not None or self._stop:
                self.queue.notify()  # the engine thread carries on with what remains

    def _user_waits(self) -> bool:
        """A user thread is blocked on a result (or drives the engine): the CPU is ours."""
        return self._spin or self.waiters > 0

    # ---- engine thread ----

    def _has_work(self) -> bool:
        return bool(self.queue.ops) or self._stop or self.neg._due

    def _run(self) -> None:
        try:
            while True:
                self.queue.sleep(WAKE_POLL_S, self._has_work)
                with self._lock:
                    if self._reason is None:
                        self.neg.woken()
                    while self._reason is None and self._has_work():
                        start = time.monotonic()
                        if self._guarded_cycle():
                            rest = self.tuned.cycle_time_ms / 1000.0 - (time.monotonic() - start)
                            if rest > 0:
                                time.sleep(rest)
                        else:
                            self._back_off()
                        if self._reason is None:
                            self.neg.woken()
                    if self._reason is not None:
                        self._teardown()
                        return
        except BaseException:  # the loop itself must never die silently
            logger.error("engine failed:\n%s", traceback.format_exc())
            self._halt(EngineShutdownError(f"mpidp's engine failed on rank {self.rank}"))

    def _back_off(self) -> None:
        """Nothing was ready although ops are pending: wait a little for the peers, unless a
        submission arrives (a cycle per submission is what keeps latency low)."""
        self.queue.sleep(_WAITING_BACKOFF_MAX_S,
                         lambda: self.queue.has_new() or self._stop or self.neg._due)

    def _teardown(self) -> None:
        if self.timeline is not None:
            self.timeline.close()
        if self.sampler is not None:
            self.sampler.close()
        if not self._clean:
            return  # an MPI call may be half done: freeing communicators could hang
        try:
            self.backend.close()  # gloo/NCCL process groups; nothing for MPI
        except Exception:  # freeing the communicators below matters more
            logger.error("closing the data path failed:\n%s", traceback.format_exc())
        self.neg.close()
        self.comms.free()

    def _stop_reason(self) -> str:
        if self.set_id:
            return (f"process set {self.set_id} was removed (a member called "
                    f"mpidp.remove_process_set() or mpidp.shutdown()) while this op was pending "
                    f"or after; add the set again on every rank to continue")
        return ("mpidp was shut down (a rank called mpidp.shutdown()) while this op was pending; "
                "call mpidp.init() again on every rank to continue")

    def _halt(self, reason: BaseException) -> None:
        """Stop for good: refuse new ops and fail every op in flight with `reason`."""
        if self._reason is None:
            self._reason = reason
        for entry in self.queue.close(self._reason):
            entry.set_error(self._reason)
        self.queue.notify()

    def _guarded_cycle(self) -> bool:
        """One cycle; an exception stops the engine (and fails every op) instead of escaping."""
        try:
            return self._cycle()
        except BaseException as exc:
            logger.error("engine failed:\n%s", traceback.format_exc())
            self._clean = False
            self._halt(EngineShutdownError(f"mpidp's engine failed on rank {self.rank}: "
                                           f"{type(exc).__name__}: {exc}"))
            if not isinstance(exc, Exception):
                raise  # KeyboardInterrupt on a driving user thread belongs to the user
            return False

    def _cycle(self) -> bool:
        """Drain, negotiate, execute, complete. True if it made progress."""
        began = time.monotonic()
        drained = self.queue.drain()
        tl = self.timeline
        if tl is not None and drained:
            tl.drained(drained, began)
        for entry in drained:
            self.neg.admit(entry)
        self.stats.cycles += 1
        if self.sampler is not None and self._tune is None:
            self._tune = self.sampler.poll(self.stats.bytes, bool(self.queue.ops))
        # Spin for the peers only while a user thread is blocked on a result: during a backward
        # pass the CPU belongs to the gradients still being computed.
        responses, stopped, params = self.neg.negotiate(
            self.queue.ops, lambda: self._stop, self._user_waits(), self._tune,
            lambda: self.timeline)
        if stopped:
            self._halt(EngineShutdownError(self._stop_reason()))
            return True
        if params is not None:
            self._tune = None
            self.tuned.switch(params, self.neg.cycles)
        tl = self.timeline  # the band may wait long: a timeline started meanwhile records
        stop = None
        if responses and responses[-1].op == OpType.SHUTDOWN:
            stop = EngineShutdownError(responses.pop().error)
        try:
            self._execute(responses, tl)
        finally:
            self._release()
        if tl is not None and (responses or drained):
            tl.cycle(began, time.monotonic(), len(responses))
        if stop is not None:
            self._halt(stop)
        return bool(responses or drained)

    def _complete(self, entry: Optional[Entry], result=None, error=None) -> None:
        if entry is not None:
            self._finished.append((entry, result, error))

    def _release(self) -> None:
        """Wake the waiters of everything this cycle finished, all at once at its end: a waiter
        woken per op would fight the engine for the GIL through the rest of the cycle."""
        for entry, result, error in self._finished:
            self.queue.finished(entry)  # first, so the waiter may reuse the name at once
            if error is not None:
                entry.set_error(error)
            else:
                entry.set_result(result)
        self._finished = []

    def _execute(self, responses: List[Response], tl: Optional[Timeline]) -> None:
        ops = self.queue.ops
        data = []
        for resp in responses:
            entry = ops.get(resp.name)
            if resp.op == OpType.ERROR:
                self._complete(entry, error=MismatchError(resp.error))
            elif resp.op == OpType.JOIN:
                self.neg.joined = False
                self._complete(ops.get(JOIN_NAME), result=(resp.last_joined, resp.serial))
            elif entry is None and resp.op == OpType.BARRIER:
                continue  # this rank is joined: the others' barrier needs nothing from it
            elif entry is None and resp.op != OpType.ALLREDUCE:
                raise AssertionError(f"response {resp.name!r} has no local entry on rank "
                                     f"{self.rank}")
            else:
                data.append(resp)
        if not data:
            return
        # The data path reports its phases (pack, mpi) through this while a timeline records.
        self.backend.timeline_mark = None if tl is None else tl.mark
        tuned = self.tuned
        for batch in fusion.plan(data, tuned.fuse_below_bytes, tuned.fusion_threshold_bytes):
            entries = [ops.get(r.name) for r in batch]
            op = batch[0].op
            nbytes = 0 if op == OpType.BARRIER else self._batch_bytes(batch)
            began = time.monotonic()
            self.stats.begin_batch(began)
            try:
                results = self.backend.execute(batch, entries, tuned.fuse_below_bytes,
                                               tuned.fusion_threshold_bytes)
            except Exception as exc:
                if self.size > 1:
                    # The peers may be inside this batch's collective, which this rank will
                    # never enter or finish: failing the op here alone would leave them
                    # waiting forever (whatever abort_on_error says), so the job ends.
                    mpi.abort_job(f"{batch[0].name!r}: the data path failed on rank "
                                  f"{self.rank} with {type(exc).__name__}: {exc}; the other "
                                  f"ranks of this collective cannot finish it, so every rank "
                                  f"of the job is ended:\n{traceback.format_exc().rstrip()}")
                logger.error("%s failed:\n%s", batch[0].name, traceback.format_exc())
                for entry in entries:  # alone, a bad buffer fails its ops, not the engine
                    self._complete(entry, error=EngineShutdownError(
                        f"{batch[0].name!r}: data path failed on rank {self.rank}: {exc}"))
                continue
            ended = time.monotonic()
            self.stats.batch(op, fusion.tensor_count(batch), nbytes, ended - began)
            if tl is not None:
                tl.batch_end(batch, began, ended, nbytes)
            for entry, result in zip(entries, results):
                self._complete(entry, result=result)
