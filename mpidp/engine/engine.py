"""The engine: sleeps until work arrives, then runs negotiation cycles and executes the ready."""

import contextlib
import threading
import time
import traceback
from typing import Dict, List, Optional

from ..errors import EngineShutdownError
from ..log import logger
from . import autotune, call_watch, interrupts, timeline
from .backends import make_backend
from .executor import Executor
from .lane import Lane
from .lane import plan as lane_plan
from .messages import OpType
from .protocol import WAKE_POLL_S, Negotiator
from .response_cache import HIT
from .stats import EngineStats
from .tensor_queue import Entry, OpState, TensorQueue, normal_mode
from .timeline import Timeline

# Longest sleep between cycles that made no progress while this rank has ops waiting for other
# ranks: bounds the delay a late peer sees without spinning through a backward pass.
_WAITING_BACKOFF_MAX_S = 1e-3


class Engine:
    """One per process set; all of its MPI calls are made under its cycle lock, by its own
    thread or by a user thread that drives an idle engine through a blocking call."""

    def __init__(self, comms, config, set_id: int = 0, shared_store=None):
        self.comms = comms
        self.set_id = set_id  # process set this engine serves (0: the global set)
        self.config = config
        self.rank, self.size = comms.rank, comms.size
        self.queue = TensorQueue()
        self.stats = EngineStats()
        self.neg = Negotiator(comms, config, self.stats)
        backend = self.sampler = None
        try:
            self.backend = backend = make_backend(comms, config, shared_store)
            self.backend.busy = self._user_waits
            self.backend.stats = self.stats
            self.tuned = autotune.Tuned(config)
            self.executor = Executor(self.backend, self.stats, self.tuned, self.rank, self.size)
            self.switches = self.tuned.switches
            # Opens its log (rank 0): may fail, as may the timeline's file below.
            self.sampler = (
                autotune.Sampler(config, self.params())
                if config.autotune and self.rank == 0
                else None
            )
            # Rank 0 of the global set only; swapped by start/stop_timeline.
            self.timeline: Optional[Timeline] = timeline.from_start(config, set_id, self.rank)
        except BaseException:
            # Close what was opened; the communicators are init()'s to free.
            self.neg.close()
            for part in (self.sampler, backend):
                if part is not None:
                    part.close()
            raise
        self._tune: Optional[Dict[str, object]] = None  # what rank 0 sends at the next cycle
        self._waiters_lock = threading.Lock()
        self.waiters = 0  # user threads blocked on a result: the band may then spin for peers
        self.cycle_lock = threading.Lock()  # the cycle lock: whoever holds it may call MPI
        self._spin = False
        self._stop = False
        self._reason: Optional[BaseException] = None  # why the engine stopped, once it has
        self.clean = True
        self._thread = threading.Thread(target=self._run, name="mpidp-engine", daemon=True)
        self.watch = call_watch.watch(self)  # stalls inside MPI calls (its own thread)
        self._lone = Lane()  # the band of a lone op that drive() runs as express() does

    def start(self) -> None:
        self._thread.start()
        self.watch.start()

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

    def running(self) -> bool:
        """The engine has not stopped for good (no stop reason yet)."""
        return self._reason is None

    def discard(self) -> None:
        """Release what an engine that was never started holds (its data paths, files and
        communicators): init() failed on some rank. Synchronization: as comms.free()."""
        self._teardown()

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
        if not self._take_cycle_lock(notify=True):
            return
        try:
            self._spin = True
            if len(entries) == 1 and self._hold(entries[0], queued=True):
                self._lone_cycle(entries[0], self._lone)  # express()'s first cycle
            while (
                self._reason is None
                and not all(e.done() for e in entries)
                and not interrupts.pending()
            ):
                if not self._guarded_cycle():
                    self._back_off()
        finally:
            self._driven()

    def lane(self, req, tensor) -> Lane:
        """The express lane's plan for allreduce request `req` of `tensor` alone (local)."""
        return lane_plan(self.backend.routes.get(tensor.device.type), req, tensor, self.size)

    def express(self, entry: Entry, plan: Lane) -> bool:
        """Run `entry`, not submitted, whose name and metadata are in the response cache, to
        completion on this thread if the engine is idle (True). Its first cycle skips the
        queue, the band's assembly and the batch planning (_lone_cycle); later ones, needed
        only if the peers were not ready for this op alone, are drive()'s. `plan`: lane() of
        its signature. False, with nothing done, when the engine is busy or the op is not
        cached: submit() it instead. Synchronization: as drive().
        """
        if not self._take_cycle_lock(notify=False):
            return False
        try:
            if not self._hold(entry):
                return False
            self._spin = True
            if not self._lone_cycle(entry, plan):
                while self._reason is None and not entry.done() and not interrupts.pending():
                    if not self._guarded_cycle():
                        self._back_off()
        finally:
            self._driven()
        return True

    def _take_cycle_lock(self, notify: bool) -> bool:
        """Take the cycle lock for this user thread if it may drive the engine and the lock is
        free (True), holding a Ctrl-C from before the lock is taken (interrupts.py): one raised
        between taking it and the `try` whose `finally` gives it back would leave it taken for
        good, and every later op of this rank waiting (a KeyboardInterrupt can land right after
        any call returns). False, holding nothing, otherwise: `notify` wakes the engine thread
        first (drive()'s ops may have been submitted without a wake-up), then a Ctrl-C held
        meanwhile is raised."""
        if not interrupts.may_drive():
            if notify:
                self.queue.notify()
            return False
        started = interrupts.defer()
        if self.cycle_lock.acquire(blocking=False):
            return True
        if notify:
            self.queue.notify()
        if started:
            interrupts.deliver()
        return False

    def _driven(self) -> None:
        """A user thread stops driving: release the cycle lock to the engine thread; raise the
        Ctrl-C held meanwhile (interrupts.py)."""
        self._spin = False
        self.cycle_lock.release()
        if self.queue.ops or self._reason is not None or self._stop:
            self.queue.notify()  # the engine thread carries on with what remains
        interrupts.deliver()

    def _hold(self, entry: Entry, queued: bool = False) -> bool:
        """Admit `entry` as the one op in flight, on its cache bit, if express() may run it;
        `queued`: it was submitted and nothing else was (drive() runs it as express() would)."""
        neg = self.neg
        if (
            self._reason is not None
            or self._stop
            or self.timeline is not None
            or self.sampler is not None
            or not neg.quiet()
        ):
            return False
        status, bit = neg.cache.lookup(entry.name, entry.cache_key)
        if status != HIT or not (self.queue.take_lone(entry) if queued else self.queue.hold(entry)):
            return False
        entry.state, entry.bit = OpState.CACHED, bit
        return True

    def _stopping(self) -> bool:
        return self._stop

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
                with self.cycle_lock:
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
        self.queue.sleep(
            _WAITING_BACKOFF_MAX_S, lambda: self.queue.has_new() or self._stop or self.neg._due
        )

    def _teardown(self) -> None:
        self.watch.stop()  # at once, not at its next look (up to a second later)
        if self.timeline is not None:
            self.timeline.close()
        if self.sampler is not None:
            self.sampler.close()
        if not self.clean:
            return  # an MPI call may be half done: freeing communicators could hang
        try:
            self.backend.close()  # gloo/NCCL process groups; nothing for MPI
        except Exception:  # freeing the communicators below matters more
            logger.error("closing the data path failed:\n%s", traceback.format_exc())
        self.neg.close()
        self.comms.free()

    def _stop_reason(self) -> str:
        if self.set_id:
            return (
                f"process set {self.set_id} was removed (a member called "
                f"mpidp.remove_process_set() or mpidp.shutdown()) while this op was pending "
                f"or after; add the set again on every rank to continue"
            )
        by = self.neg.stopped_by
        who = (
            "a rank"
            if not by
            else (
                f"rank{'s' if len(by) > 1 else ''} "
                + ", ".join(f"{r} (host {self.comms.hosts[r]})" for r in by)
            )
        )
        return (
            f"mpidp was shut down by {who} (mpidp.shutdown(), or its script ended) while "
            f"this op was pending; if all ranks still run, mpidp.init() on each starts over"
        )

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
            with normal_mode():  # a user thread in inference mode may drive it
                return self._cycle()
        except BaseException as exc:
            return self._cycle_failed(exc)

    def _lone_cycle(self, entry: Entry, plan: Lane) -> bool:
        """The first cycle of a lone held op (express(), drive()) with its `plan`; True when it
        completed the op. The band carries its bit alone; when every rank is ready for this op
        and nothing else, the plan's data path runs it at once: no draining, no band assembly,
        no batch planning, none of a general cycle's layers (the express lane's latency is in
        its Python calls). Any other answer is concluded as a general cycle concludes it."""
        try:
            neg = self.neg
            self.stats.cycles += 1
            sent = plan.band(entry.bit, neg.cache.num_bits)
            responses, stopped, params = neg.negotiate_one(
                entry, self.queue.ops, self._stopping, sent
            )
            if (
                plan.op is not None
                and params is None
                and len(responses) == 1
                and responses[0].name == entry.name
                and responses[0].op == OpType.ALLREDUCE
            ):
                self.executor.run_lone(responses[0], entry, self.queue, plan)  # the common case
                return True
            with normal_mode():
                # The op was made just before this cycle: its time stands for the cycle's start.
                self._conclude(responses, stopped, params, [entry], entry.submitted)
            return entry.done()
        except BaseException as exc:
            return self._cycle_failed(exc)

    def _cycle_failed(self, exc: BaseException) -> bool:
        """A cycle raised `exc`: stop the engine and fail every op (False: no progress);
        re-raise a KeyboardInterrupt, which belongs to the user thread that drove the cycle."""
        logger.error(
            "engine failed on rank %d%s",
            self.rank,
            (
                ": a second Ctrl-C before the first one's cycle ended"
                if isinstance(exc, KeyboardInterrupt)
                else ":\n" + traceback.format_exc()
            ),
        )
        self.clean = False  # peers may be in a collective it left: shutdown() ends the job
        self._halt(
            EngineShutdownError(
                f"mpidp's engine failed on rank {self.rank}: {type(exc).__name__}: {exc}"
            )
        )
        if not isinstance(exc, Exception):
            raise exc
        return False

    def _cycle(self) -> bool:
        """Drain, negotiate, execute, complete. True if it made progress."""
        began = time.monotonic()
        self.stats.cycles += 1
        drained = self.queue.drain()
        if self.timeline is not None and drained:
            self.timeline.drained(drained, began)
        for entry in drained:
            self.neg.admit(entry)
        if self.sampler is not None and self._tune is None:
            self._tune = self.sampler.poll(self.stats.bytes, bool(self.queue.ops))
        # Spin for the peers only while a user thread is blocked on a result: during a
        # backward pass the CPU belongs to the gradients still being computed.
        responses, stopped, params = self.neg.negotiate(
            self.queue.ops,
            self._stopping,
            self._user_waits(),
            self._tune,
            lambda: self.timeline,
        )
        return self._conclude(responses, stopped, params, drained, began)

    def _conclude(self, responses, stopped: bool, params, drained: List[Entry], began: float):
        """The rest of a cycle once the band was read: stop, switch parameters, execute the
        responses, complete. True if the cycle made progress."""
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
            self.executor.run(responses, self.queue.ops, self.neg, tl)
        finally:
            self.executor.release(self.queue)
        if tl is not None and (responses or drained):
            tl.cycle(began, time.monotonic(), len(responses))
        if stop is not None:
            self._halt(stop)
        return bool(responses or drained)
