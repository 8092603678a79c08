"""The negotiation protocol: how the ranks of one engine agree, cycle by cycle, on which ops run.

Cycles. The k-th cycle is the k-th negotiation on the engine's control communicator, so every
rank runs the same cycles in the same order. A rank runs a cycle only while it has work (an op in
flight, a stop request, or a wake-up from a peer); otherwise it sleeps and makes no MPI call at
all but a low-rate probe for a wake-up message. A peer that runs cycle k meanwhile
waits for it inside a non-blocking collective, which it polls with a bounded back-off.

One cycle, on every rank:
 1. Admit the new ops. An op whose name was negotiated before with the same metadata has a
    response-cache bit and waits on it (CACHED); any other op goes to the coordinator (TO_SEND).
 2. Band: a bitwise-AND allreduce of one uint64 vector of 2w + 1 words, w = ceil(bits / 64):
    words [0, w) hold the bits of this rank's CACHED ops; words [w, 2w) the complement of the
    bits this rank found invalid (cached under other metadata); the last word the complement of
    this rank's flags. The complements make the AND an OR for those two parts (band.py packs and
    reads it). Flags: UNCACHED (some rank has ops for the coordinator), SHUTDOWN (some rank
    stops), STALL (some rank asks for a stall check), JOINED (some rank has joined), TUNE (rank 0
    sends autotuned parameters).
 3. With SHUTDOWN set, every rank stops after this cycle and fails its ops with the reason.
    Invalid bits are evicted on every rank (ops waiting on them go to the coordinator). Bits set
    on every rank are ready, in bit order: identical everywhere. With JOINED, no bit is ready and
    every CACHED op goes to the coordinator, which knows who has joined.
 4. Slow path, when a flag but SHUTDOWN or an invalid bit is set: rank 0 gathers every rank's (new
    requests, stall snapshot, request ages), pickled (lengths, then bytes). It counts per name which
    ranks sent it; a name is ready once every rank sent it but those joined (except under the name
    prefixes a joined rank's JOIN says it still serves). It checks that dtype, shape, op, reduce op,
    scale factors, root and device kind agree; a disagreement becomes an ERROR response naming the
    ranks and the field, so that op fails on every rank with the same message and the next one still
    works. When every rank has joined it appends JOIN (with the rank that joined last, and the names
    still waiting for some ranks, which those send to the coordinator even if cached); with STALL
    the stall inspector logs the ops some ranks miss, naming them, and past the stall limit appends
    SHUTDOWN. Rank 0 broadcasts the ordered responses (with TUNE, the new parameters too). Every
    rank puts the successful responses into its cache in that order, so the caches stay identical.
 5. Every rank executes the cache hits, then the coordinator's responses, in order. A joined rank
    executes allreduces it did not submit with zeros and skips everything else it did not submit.

A lone cached op on a rank with nothing else to say (Engine.express) builds its band from its bit
alone and, if it comes back unchanged, skips steps 3-4 (negotiate_one).

Wake-ups. A rank that needs peers in a cycle they may sleep through (to stop them, or to have them
report for a stall check) sends each peer the pair (k, flags) on the wake communicator, k being the
cycle it is in (and the engine's epoch, so a wake-up left by an earlier engine is dropped). It sends
at the start of the cycle, or while it waits in the band once the reason arises. An engine probes
for wake-ups between cycles and, while asleep, every WAKE_POLL_S. A wake for a cycle it has not
run yet makes it run that cycle with those flags in its band; a wake for a cycle it already ran is
dropped. Ops need no wake-up: every rank's own submission wakes its own engine. Stall detection thus
works with sleeping peers: a waiting rank raises STALL in its band and wakes its peers, so the
coordinator gets every rank's snapshot and names the missing ranks.
"""

import time
from typing import Callable, Dict, List, Optional, Tuple

from . import band as layout
from . import mpi
from .messages import ORDERED_PREFIX, OpType, Request, Response
from .negotiation import MessageTable
from .response_cache import HIT, INVALID, ResponseCache
from .stall import StallInspector
from .tensor_queue import Entry, OpState

F_UNCACHED, F_SHUTDOWN, F_STALL, F_JOINED, F_TUNE = 1, 2, 4, 8, 16
_WAKING = F_SHUTDOWN | F_STALL  # the flags worth waking a sleeping peer for
CACHEABLE = (
    OpType.ALLREDUCE,
    OpType.ALLGATHER,
    OpType.BROADCAST,
    OpType.ALLTOALL,
    OpType.REDUCESCATTER,
)
# How often a sleeping engine tests for wake-ups: a peer's shutdown or stall check reaches it
# within this. The test itself costs under 1 us, but waking the thread costs about 150 us of CPU
# on this VM (timer wake-ups are dear here): 0.05 s measured 0.30 % of a core, hence 0.1 s.
WAKE_POLL_S = 0.1


class Negotiator:
    """One engine's side of the protocol: cache, coordinator table (rank 0), stall inspector,
    wake-ups. Used under the engine's cycle lock only."""

    def __init__(self, comms, config, stats):
        self.rank, self.size = comms.rank, comms.size
        self.control = comms.control
        self.box = mpi.WakeBox(comms.wake, comms.epoch)
        self.peers = [r for r in range(self.size) if r != self.rank]
        self.cache = ResponseCache(config.cache_capacity)
        self.table = MessageTable(self.size) if self.rank == 0 else None
        self.stall = StallInspector(
            self.size, config.stall_warning_s, config.stall_shutdown_s, config.order_check_s
        )
        self.stats = stats
        self.invalid = set()
        self.joined = False  # this rank's JOIN is pending
        self.resend = set()  # names to send the coordinator, not to cache bits (Response.pending)
        self.cycles = 0  # cycles completed: the same count on every rank between cycles
        self._woken = 0  # flags that peers' wake-ups ask for in the next cycle
        self._due = False  # a wake-up asks this rank to run the next cycle
        self._asked_stop = False  # this rank raised SHUTDOWN in the cycle in flight
        self.stopped_by: List[int] = []  # the ranks that raised SHUTDOWN, once it is agreed

    # ---- between cycles ----

    def admit(self, entry: Entry) -> None:
        """Put a drained op on the fast path (its cache bit) or the slow path."""
        req = entry.request
        entry.state = OpState.TO_SEND
        if req.op == OpType.JOIN:
            self.joined = True
        elif self.resend and req.name in self.resend:
            self.resend.discard(req.name)
        elif req.cacheable and self.cache.capacity:
            status, bit = self.cache.lookup(req.name, entry.cache_key)
            if status == HIT:
                entry.state, entry.bit = OpState.CACHED, bit
            elif status == INVALID:
                self.invalid.add(bit)

    def woken(self) -> bool:
        """Whether a peer's wake-up asks this rank to run the next cycle (tests the receive)."""
        for cycle, flags in self.box.take():
            if cycle >= self.cycles:
                self._woken |= flags
                self._due = True
        return self._due

    def close(self) -> None:
        self.box.close()

    # ---- one cycle ----

    def negotiate(
        self,
        ops: Dict[str, Entry],
        stopping: Callable[[], bool],
        spin: bool,
        tune=None,
        timeline=lambda: None,
    ) -> Tuple[List[Response], bool, Optional[dict]]:
        """Run steps 2-4 for the admitted ops in `ops`: (ready responses in order, whether the
        engine stops, autotune parameters to switch to or None). `timeline()` gives the
        timeline to record in, read after the band (one may be started while it waits).

        Synchronization: one band allreduce on every rank of the engine, and with the slow path
        a gather and a broadcast at rank 0.
        """
        admitted = [e for e in ops.values() if e.state != OpState.NEW]
        flags, self._woken, self._due = self._woken, 0, False
        if any(e.state == OpState.TO_SEND for e in admitted):
            flags |= F_UNCACHED
        if stopping():
            flags |= F_SHUTDOWN
        if self.joined:
            flags |= F_JOINED
        oldest = min((e.submitted for e in admitted), default=0.0)
        if admitted and self._check_due(admitted, oldest):
            flags |= F_STALL
        if tune is not None:
            flags |= F_TUNE
        cached = layout.bits_int(e.bit for e in admitted if e.state == OpState.CACHED)
        band = layout.pack(
            layout.part_bytes(self.cache.num_bits), cached, layout.bits_int(self.invalid), flags
        )
        self.invalid = set()
        self._exchange(band, flags, admitted, oldest, stopping, spin)
        return self._read(band, ops, admitted, tune, timeline)

    def quiet(self) -> bool:
        """Nothing but a new op would go into the next band: no wake-up due, no join pending,
        no invalid bit to announce (Engine.express may then run negotiate_one)."""
        return not (self._due or self._woken or self.joined or self.invalid or self.resend)

    def negotiate_one(
        self, entry: Entry, ops: Dict[str, Entry], stopping: Callable[[], bool], sent: bytes
    ):
        """negotiate() for a lone CACHED op on a quiet() rank, spinning: the band `sent` is
        this op's bit alone (lane.Lane.band), and when it comes back unchanged (every rank is
        ready for this op and nothing else) the answer is its cached response without parsing
        the band. Any other band is read as negotiate() reads it. Synchronization: as
        negotiate().
        """
        band = bytearray(sent)
        self._exchange(band, 0, [entry], entry.submitted, stopping, True)
        if band != sent:
            return self._read(band, ops, [entry], None, lambda: None)
        self.cache.touch(entry.bit)
        self.stats.cache_hits += 1
        self.stats.end_negotiation(time.monotonic())
        return [self.cache.response(entry.bit)], False, None

    def _check_due(self, admitted: List[Entry], oldest: float) -> bool:
        """Whether to ask for a stall check: an op waited too long (or an ordered one, which
        torch.distributed's calls are, past order_check_s: the ranks may disagree)."""
        now = time.monotonic()
        ordered = (
            min((e.submitted for e in admitted if e.name.startswith(ORDERED_PREFIX)), default=now)
            if self.stall.order_check_s > 0
            else now
        )
        return self.stall.should_raise(now - oldest, now - ordered)

    def _exchange(
        self,
        band: bytearray,
        flags: int,
        admitted: List[Entry],
        oldest: float,
        stopping: Callable[[], bool],
        spin: bool,
    ) -> None:
        """Step 2: the band allreduce, waking sleeping peers when a reason arises (now or
        while it waits); counts the cycle."""
        sent = flags & _WAKING
        if sent:
            self.box.send(self.cycles, sent, self.peers)

        def poll():  # while the band waits: wake sleeping peers if a reason arose meanwhile
            nonlocal sent
            extra = F_SHUTDOWN if not sent & F_SHUTDOWN and stopping() else 0
            if admitted and self._check_due(admitted, oldest):
                extra |= F_STALL
            if extra:
                sent |= extra
                self.box.send(self.cycles, extra, self.peers)

        self.stats.begin_negotiation(time.monotonic())
        mpi.allreduce_band(self.control, band, spin, poll)
        # Its own stop, not a peer's relayed by a wake-up (which `flags` may carry).
        self._asked_stop = stopping()
        self.cycles += 1

    def _read(self, band: bytearray, ops: Dict[str, Entry], admitted: List[Entry], tune, timeline):
        """Steps 3-4 on the reduced band: negotiate()'s result."""
        st = self.stats
        timeline = timeline()
        ready, invalid_bits, flags = layout.unpack(band)
        if flags & F_SHUTDOWN:
            # Every rank is in this cycle: one more small collective says who stops, so the
            # others' errors name the rank (and host) whose script ended or called shutdown().
            # With it, what each rank sent this one: the last cycle takes every wake-up still
            # on its way, none is left unreceived at exit.
            said = mpi.allgather_object(self.control, (self._asked_stop, self.box.sent))
            self.stopped_by = [r for r, (yes, _) in enumerate(said) if yes]
            self.box.drain(sum(sent[self.rank] for _, sent in said))
            st.end_negotiation(time.monotonic())
            return [], True, None
        invalid = layout.int_bits(invalid_bits)
        for bit in invalid:
            self.cache.evict(bit)
        self._unbit(admitted, set(invalid))
        responses: List[Response] = []
        if not flags & F_JOINED:
            for bit in layout.int_bits(ready):
                responses.append(self.cache.response(bit))
                self.cache.touch(bit)
        st.cache_hits += len(responses)
        if timeline is not None and responses:
            timeline.negotiated(responses, time.monotonic(), "cache")
        params = None
        if flags & (F_UNCACHED | F_STALL | F_JOINED | F_TUNE) or invalid:
            if flags & F_JOINED:
                self._unbit(admitted, None)
            slow, params = self._slow_path(flags, ops, admitted, tune, timeline)
            st.slow_cycles += 1
            if timeline is not None and slow:
                timeline.negotiated(slow, time.monotonic(), "coordinator")
            responses.extend(slow)
        st.end_negotiation(time.monotonic())
        return responses, False, params

    @staticmethod
    def _unbit(admitted: List[Entry], bits) -> None:
        """Ops waiting on `bits` (None: on any bit) go to the coordinator instead."""
        for e in admitted:
            if e.state == OpState.CACHED and (bits is None or e.bit in bits):
                e.state, e.bit = OpState.TO_SEND, -1

    def _slow_path(self, flags: int, ops, admitted: List[Entry], tune, tl):
        outgoing = [e for e in admitted if e.state == OpState.TO_SEND]
        now = time.monotonic()
        requests = [e.request for e in outgoing]
        # How long each request waited here: rank 0's timeline places every rank's submission.
        ages = [now - e.submitted for e in outgoing]
        for e in outgoing:
            e.state = OpState.SENT
        snapshot = (
            [(e.request.name, now - e.submitted) for e in admitted] if flags & F_STALL else None
        )
        gathered = mpi.gather_objects(self.control, (requests, snapshot, ages), 0)
        responses = None
        if self.rank == 0:
            # rank 0 is the root (it gathered every rank's) and the coordinator (it has a table)
            assert gathered is not None and self.table is not None
            now = time.monotonic()
            for rank, (reqs, _, waited) in enumerate(gathered):
                self.table.add(rank, reqs)
                if tl is not None and reqs:
                    tl.arrived(rank, reqs, waited, now)
            responses = self.table.ready()
            if flags & F_STALL:
                snapshots = {r: snap for r, (_, snap, _) in enumerate(gathered)}
                disorder = self.stall.disorder(snapshots, self.table.joined)
                if disorder is not None:
                    names, error = disorder
                    self.table.drop(names)
                    responses += [
                        Response(n, OpType.ERROR, Request(n, OpType.ERROR), error=error)
                        for n in names
                    ]
                reason = self.stall.inspect(
                    {r: snap for r, (_, snap, _) in enumerate(gathered)}, self.table.joined
                )
                if reason:
                    responses.append(
                        Response("", OpType.SHUTDOWN, Request("", OpType.SHUTDOWN), error=reason)
                    )
        params = None
        if flags & F_TUNE:
            # Every rank takes rank 0's new parameters before executing this cycle's batches.
            responses, params = mpi.bcast_object(self.control, (responses, tune), 0)
        else:
            responses = mpi.bcast_object(self.control, responses, 0)
        for resp in responses:
            if resp.op not in CACHEABLE:
                continue
            self.stats.cache_misses += 1
            if not resp.request.cacheable:
                continue
            entry = ops.get(resp.name)
            key = entry.cache_key if entry is not None else resp.request.signature()
            evicted = self.cache.put(resp, key)
            if evicted is not None:
                self._unbit(admitted, {evicted})
        return responses, params
