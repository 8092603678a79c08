"""The engine thread: drain, negotiate (cache bits, then coordinator), fuse, execute, complete."""

import contextlib
import threading
import time
import traceback
from typing import Dict, List, Optional

import numpy as np

from ..errors import EngineShutdownError, MismatchError
from ..log import logger
from . import autotune, fusion, mpi
from .backends import make_backend
from .messages import JOIN_NAME, OpType, Response
from .negotiation import MessageTable
from .response_cache import HIT, INVALID, ResponseCache
from .stall import StallInspector
from .stats import BatchBytes, EngineStats
from .tensor_queue import Entry, TensorQueue
from .timeline import Timeline

# Status flags travel inverted in the AND-reduced vector, which makes the AND an OR for them.
# F_TUNE: rank 0 broadcasts new autotuned parameters with this cycle's responses.
F_UNCACHED, F_SHUTDOWN, F_STALL, F_JOINED, F_TUNE = 1, 2, 4, 8, 16
_CACHEABLE = (OpType.ALLREDUCE, OpType.ALLGATHER, OpType.BROADCAST, OpType.ALLTOALL,
              OpType.REDUCESCATTER)
# Longest sleep between cycles while this rank has ops waiting for other ranks: bounds the delay
# a late peer sees (about 1 ms, as one Horovod cycle) without spinning through a backward pass.
_WAITING_BACKOFF_MAX_S = 1e-3


def _pack_bits(bits, words: int) -> np.ndarray:
    flags = np.zeros(words * 64, dtype=np.uint8)
    if bits:
        flags[list(bits)] = 1
    return np.packbits(flags, bitorder="little").view(np.uint64)


def _unpack_bits(vec: np.ndarray) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(vec.view(np.uint8), bitorder="little"))


class Engine:
    """One per init(); all of its MPI calls happen on its own thread, on its own communicators."""

    def __init__(self, comms, config, set_id: int = 0):
        self.comms = comms
        self.set_id = set_id  # process set this engine serves (0: the global set)
        self.config = config
        self.rank, self.size = comms.rank, comms.size
        self.queue = TensorQueue()
        self.cache = ResponseCache(config.cache_capacity)
        self.table = MessageTable(self.size) if self.rank == 0 else None
        self.stall = StallInspector(self.size, config.stall_warning_s, config.stall_shutdown_s)
        self.backend = make_backend(comms, config)
        self.pending: Dict[str, Entry] = {}
        self.cached: Dict[int, Entry] = {}   # bit -> entry waiting on the fast path
        self.to_send: List[Entry] = []
        self.invalid = set()
        self.joined = False
        self.stats = EngineStats()
        self._batch_bytes = BatchBytes(fusion.nbytes)
        # The knobs autotune may change; every rank changes them at the same cycle.
        self.fusion_threshold_bytes = config.fusion_threshold_bytes
        self.fuse_below_bytes = config.fuse_below_bytes
        self.cycle_time_ms = config.cycle_time_ms
        self.sampler = autotune.Sampler(config, self.params()) \
            if config.autotune and self.rank == 0 else None
        self._tune = None  # parameters rank 0 sends at the next coordinator cycle
        self.switches: List[tuple] = []  # (cycle, parameters) of every autotune switch
        self.timeline: Optional[Timeline] = None  # rank 0 only; swapped by start/stop_timeline
        if config.timeline_path and set_id == 0 and self.rank == 0:
            try:
                self.timeline = Timeline(config.timeline_path, config.timeline_mark_cycles)
            except OSError as exc:  # raising here would leave the other ranks' engines waiting
                logger.error("timeline: cannot write %r (%s); running without a timeline",
                             config.timeline_path, exc)
        self.waiters = 0  # user threads blocked in synchronize(); read by the engine thread
        self._finished: list = []  # (entry, result, error) completed in this cycle
        self._stop = False
        self.error: Optional[BaseException] = None  # why the engine stopped, once it has
        self._thread = threading.Thread(target=self._run, name="mpidp-engine", daemon=True)

    # ---- user-thread side ----

    def start(self) -> None:
        self._thread.start()

    def submit(self, entries: List[Entry]) -> None:
        """Enqueue; raises the engine's stop reason if it has stopped."""
        self.queue.push(entries)

    def stop(self, timeout: Optional[float] = None) -> bool:
        """Ask every rank's engine to stop at the next cycle; True once this thread has ended."""
        self._stop = True
        self.queue.wake.set()
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def params(self) -> dict:
        """The autotunable knobs' current values on this rank."""
        return {"fusion_threshold_bytes": self.fusion_threshold_bytes,
                "fuse_below_bytes": self.fuse_below_bytes, "cycle_time_ms": self.cycle_time_ms}

    @contextlib.contextmanager
    def user_waiting(self):
        """Marks a user thread as blocked on a result (the engine may then spin for peers)."""
        self.waiters += 1
        try:
            yield
        finally:
            self.waiters -= 1

    # ---- engine thread ----

    def _run(self) -> None:
        reason = None
        clean = False
        try:
            backoff = 0.0
            max_backoff = self.config.idle_backoff_max_ms / 1000.0
            while reason is None:
                start = time.monotonic()
                progress, reason = self._cycle()
                if reason is not None:
                    break
                if progress:
                    backoff = 0.0
                    rest = self.cycle_time_ms / 1000.0 - (time.monotonic() - start)
                    if rest > 0:
                        time.sleep(rest)
                else:
                    # No progress: sleep unless woken by a submission, longer the longer nothing
                    # happens. Spinning here would take the CPU from the ranks still computing
                    # the gradients this rank waits for; while ops wait, the cap stays short.
                    cap = min(max_backoff, _WAITING_BACKOFF_MAX_S) if self.pending else max_backoff
                    backoff = min(cap, max(5e-5, backoff * 2))
                    self.queue.sleeping = True
                    if not self.queue.has_new() and not self._stop:
                        self.queue.wake.wait(backoff)
                    self.queue.sleeping = False
            clean = True
        except BaseException as exc:  # the engine must never die silently
            logger.error("engine failed:\n%s", traceback.format_exc())
            reason = EngineShutdownError(f"mpidp's engine failed on rank {self.rank}: "
                                         f"{type(exc).__name__}: {exc}")
        self.error = reason
        self._fail_all(reason)
        if self.timeline is not None:
            self.timeline.close()
        if self.sampler is not None:
            self.sampler.close()
        if clean:
            try:
                self.backend.close()  # gloo/NCCL process groups; nothing for MPI
            except Exception:  # freeing the communicators below matters more
                logger.error("closing the data path failed:\n%s", traceback.format_exc())
            self.comms.free()

    def _stop_reason(self) -> str:
        if self.set_id:
            return (f"process set {self.set_id} was removed (a member called "
                    f"mpidp.remove_process_set() or mpidp.shutdown()) while this op was pending "
                    f"or after; add the set again on every rank to continue")
        return ("mpidp was shut down (a rank called mpidp.shutdown()) while this op was pending; "
                "call mpidp.init() again on every rank to continue")

    def _fail_all(self, reason: BaseException) -> None:
        leftovers = self.queue.close(reason)
        for entry in list(self.pending.values()) + leftovers:
            entry.handle.set_error(reason)
        self.pending.clear()
        self.cached.clear()
        self.to_send.clear()

    def _admit(self, entry: Entry) -> None:
        req = entry.request
        self.pending[req.name] = entry
        if req.op == OpType.JOIN:
            self.joined = True
        elif req.cacheable and self.cache.capacity:
            status, bit = self.cache.lookup(req.name, entry.cache_key)
            if status == HIT:
                entry.bit = bit
                self.cached[bit] = entry
                return
            if status == INVALID:
                self.invalid.add(bit)
        self.to_send.append(entry)

    def _unbit(self, bit: int) -> None:
        """A cache bit went away: whatever waited on it goes to the coordinator instead."""
        entry = self.cached.pop(bit, None)
        if entry is not None:
            entry.bit = -1
            self.to_send.append(entry)

    def _oldest_age(self) -> float:
        if not self.pending:
            return 0.0
        return time.monotonic() - min(e.submitted for e in self.pending.values())

    def _cycle(self):
        self.queue.wake.clear()
        began = time.monotonic()
        tl = self.timeline
        drained = self.queue.drain()
        if tl is not None and drained:
            tl.drained(drained, began)
        for entry in drained:
            self._admit(entry)
        st = self.stats
        st.cycles += 1
        words = (self.cache.num_bits + 63) // 64
        flags = 0
        if self.to_send:
            flags |= F_UNCACHED
        if self._stop:
            flags |= F_SHUTDOWN
        if self.joined:
            flags |= F_JOINED
        if self.pending and self.stall.should_raise(self._oldest_age()):
            flags |= F_STALL
        if self.sampler is not None:
            if self._tune is None:
                self._tune = self.sampler.poll(st.bytes, bool(self.pending))
            if self._tune is not None:
                flags |= F_TUNE
        vec = np.empty(2 * words + 1, dtype=np.uint64)
        vec[:words] = _pack_bits(self.cached, words)
        vec[words:2 * words] = ~_pack_bits(self.invalid, words)
        vec[-1] = ~np.uint64(flags)
        self.invalid = set()
        st.begin_negotiation(time.monotonic())
        # Spin for the peers only while a user thread is blocked on a result: during a backward
        # pass the CPU belongs to the gradients still being computed.
        mpi.allreduce_band(self.comms.control, vec, spin=self.waiters > 0)
        # The band may wait long for peers: a timeline started meanwhile records from here.
        tl = self.timeline
        flags = int(~vec[-1])
        if flags & F_SHUTDOWN:
            return False, EngineShutdownError(self._stop_reason())
        invalid = _unpack_bits(~vec[words:2 * words])
        for bit in invalid:
            self.cache.evict(int(bit))
            self._unbit(int(bit))
        responses: List[Response] = []
        if not flags & F_JOINED:
            for bit in _unpack_bits(vec[:words]):
                bit = int(bit)
                responses.append(self.cache.response(bit))
                self.cache.touch(bit)
                del self.cached[bit]
        st.cache_hits += len(responses)
        if tl is not None and responses:
            tl.negotiated(responses, time.monotonic(), "cache")
        if flags & (F_UNCACHED | F_STALL | F_JOINED | F_TUNE) or len(invalid):
            slow = self._slow_path(flags, tl)
            st.slow_cycles += 1
            if tl is not None and slow:
                tl.negotiated(slow, time.monotonic(), "coordinator")
            responses.extend(slow)
        st.end_negotiation(time.monotonic())
        stop = None
        if responses and responses[-1].op == OpType.SHUTDOWN:
            stop = EngineShutdownError(responses.pop().error)
        try:
            self._execute(responses, tl)
        finally:
            self._release()
        if tl is not None and (responses or drained):
            tl.cycle(began, time.monotonic(), len(responses))
        return bool(responses or drained), stop

    def _slow_path(self, flags: int, tl: Optional[Timeline]) -> List[Response]:
        if flags & F_JOINED:
            for bit in list(self.cached):
                self._unbit(bit)
        requests = [e.request for e in self.to_send]
        # How long each request waited here: rank 0's timeline places every rank's submission.
        now = time.monotonic()
        ages = [now - e.submitted for e in self.to_send]
        self.to_send = []
        snapshot = None
        if flags & F_STALL:
            now = time.monotonic()
            snapshot = [(name, now - e.submitted) for name, e in self.pending.items()]
        gathered = mpi.gather_objects(self.comms.control, (requests, snapshot, ages), 0)
        responses = None
        if self.rank == 0:
            now = time.monotonic()
            for rank, (reqs, _, waited) in enumerate(gathered):
                self.table.add(rank, reqs)
                if tl is not None and reqs:
                    tl.arrived(rank, reqs, waited, now)
            responses = self.table.ready()
            if flags & F_STALL:
                reason = self.stall.inspect({r: snap for r, (_, snap, _) in enumerate(gathered)},
                                            self.table.joined)
                if reason:
                    responses.append(Response("", OpType.SHUTDOWN, error=reason))
        if flags & F_TUNE:
            # Every rank takes rank 0's new parameters before executing this cycle's batches.
            responses, params = mpi.bcast_object(self.comms.control, (responses, self._tune), 0)
            self._tune = None
            self._set_params(params)
        else:
            responses = mpi.bcast_object(self.comms.control, responses, 0)
        for resp in responses:
            if resp.op in _CACHEABLE:
                self.stats.cache_misses += 1
            if resp.op in _CACHEABLE and resp.request.cacheable:
                entry = self.pending.get(resp.name)
                key = entry.cache_key if entry is not None else resp.request.signature()
                evicted = self.cache.put(resp, key)
                if evicted is not None:
                    self._unbit(evicted)
                bit = self.cache.lookup(resp.name, key)[1]
                # Executed now, so it must not also wait on the bit it was just given.
                self.cached.pop(bit, None)
        return responses

    def _set_params(self, params: dict) -> None:
        for field, value in params.items():
            setattr(self, field, value)
        # Cycles run in lockstep (one band per cycle), so the count names the same cycle on
        # every rank.
        self.switches.append((self.stats.cycles, dict(params)))
        logger.debug("autotune: switched to %s at cycle %d", params, self.stats.cycles)

    def _complete(self, entry: Optional[Entry], result=None, error=None) -> None:
        if entry is not None:
            self._finished.append((entry, result, error))

    def _release(self) -> None:
        """Wake the waiters of everything this cycle finished, all at once at its end: a waiter
        woken per tensor would fight the engine for the GIL through the rest of the cycle."""
        for entry, result, error in self._finished:
            self.pending.pop(entry.request.name, None)
            self.queue.finished(entry.request.name)
            if error is not None:
                entry.handle.set_error(error)
            else:
                entry.handle.set_result(result)
        self._finished = []

    def _execute(self, responses: List[Response], tl: Optional[Timeline]) -> None:
        data = []
        for resp in responses:
            entry = self.pending.get(resp.name)
            if resp.op == OpType.ERROR:
                self._complete(entry, error=MismatchError(resp.error))
            elif resp.op == OpType.JOIN:
                self.joined = False
                self._complete(self.pending.get(JOIN_NAME), result=(resp.last_joined, resp.serial))
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
        for batch in fusion.plan(data, self.fuse_below_bytes, self.fusion_threshold_bytes):
            entries = [self.pending.get(r.name) for r in batch]
            op = batch[0].op
            nbytes = 0 if op == OpType.BARRIER else self._batch_bytes(batch)
            began = time.monotonic()
            self.stats.begin_batch(began)
            try:
                results = self.backend.execute(batch, entries)
            except Exception as exc:  # a bad buffer fails its ops, not the engine
                logger.error("%s failed:\n%s", batch[0].name, traceback.format_exc())
                for entry in entries:
                    self._complete(entry, error=EngineShutdownError(
                        f"{batch[0].name!r}: data path failed on rank {self.rank}: {exc}"))
                continue
            ended = time.monotonic()
            self.stats.batch(op, len(batch), nbytes, ended - began)
            if tl is not None:
                tl.batch_end(batch, began, ended, nbytes)
            for entry, result in zip(entries, results):
                self._complete(entry, result=result)
