"""Names of a group's torch.distributed calls: the same on every rank, reused so the cache hits."""

import threading
from typing import Dict, List, Sequence

from ..errors import MismatchError
from ..ops.waits import when_done

# Ops of one signature in flight at once on a group before the next waits for the oldest: a
# name is reused every NAMES_PER_SIGNATURE calls, so that repeated calls hit the engine's
# response cache (and a blocking allreduce takes the express lane) while async ones overlap.
# Each name's first call goes through the coordinator: a DDP bucket, called once a step, is
# cached from the 5th step on (with 16 names, from the 17th: slower over a short run).
NAMES_PER_SIGNATURE = 4


class CallNames:
    """Names calls by kind and signature (dtypes and, where ranks must agree on them, shapes)
    and by their count: ranks that make the same calls in the same order, as torch requires,
    give each call the same name; a rank that calls something else is found out by the engine
    (a mismatch when the names agree, the stall report naming the ranks when they do not)."""

    def __init__(self, tag: str):
        self._tag = tag
        self._slots: Dict[tuple, list] = {}  # signature -> [its names, calls made]
        self._inflight: Dict[str, int] = {}
        self._lock = threading.Lock()

    def next(self, kind: str, tensors: Sequence, shaped: bool = True) -> str:
        """The next `kind` call's name. `shaped=False` for calls whose tensors may differ in
        shape between ranks (all-to-all, gather, scatter). May wait for the call that last
        had the name, if it is still in flight. Synchronization: that call's, if so."""
        if len(tensors) == 1:  # most calls: a key without a tuple per tensor
            t = tensors[0]
            sig: tuple = (kind, t.dtype, t.shape if shaped else ())
        else:
            sig = (kind,) + tuple((t.dtype, t.shape if shaped else ()) for t in tensors)
        with self._lock:
            slot = self._slots.get(sig)  # [its names, calls made]: one lookup per call
            if slot is None:
                slot = self._slots[sig] = [self._made(kind, tensors, shaped), 0]
            n = slot[1]
            slot[1] = n + 1
        name = slot[0][n % NAMES_PER_SIGNATURE]
        if not self._inflight:
            return name
        pending = self._inflight.pop(name, None)
        if pending is not None:
            # Every rank submitted that call before this one, so it completes. Waited for, not
            # synchronized: its result is its work's, which may be waited for later.
            done = threading.Event()
            try:
                when_done(pending, done.set)
            except ValueError:
                return name  # its work synchronized it meanwhile: the handle is spent
            done.wait()
        return name

    def _made(self, kind: str, tensors: Sequence, shaped: bool) -> List[str]:
        text = ";".join(
            f"{str(t.dtype).replace('torch.', '')}{list(t.shape) if shaped else []}"
            for t in tensors
        )
        return [f"torch.{self._tag}.{kind}.{text}#{k}" for k in range(NAMES_PER_SIGNATURE)]

    def failed(self, error: BaseException) -> None:
        """A call failed with `error`: after a MismatchError (the ranks disagreed, so their
        counts may differ) every rank starts counting afresh, as each gets the error for the
        calls it waits on, so the group's next calls match again."""
        if isinstance(error, MismatchError):
            with self._lock:
                for slot in self._slots.values():
                    slot[1] = 0
                self._inflight.clear()

    def submitted(self, name: str, handle: int) -> int:
        """Note that `name`'s call is in flight as `handle`; returns the handle."""
        self._inflight[name] = handle
        return handle
