"""torch.distributed's Work over mpidp's handles: wait() drives the engine, futures complete."""

import queue
import threading
from typing import Callable, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..log import logger
from ..ops.waits import synchronize, when_done


class _Completions:
    """The thread that completes the futures of works no one waits on (DDP's buckets: its
    reducer waits on the futures, never on the works).

    The engine reports a finished op from inside its cycle, where nothing may block and no
    other op may be waited for; a future's callbacks (a comm hook's `then`) may do both, so
    the engine only queues the work here and this thread completes it.
    """

    def __init__(self):
        self._queue: "queue.SimpleQueue[Work]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()

    def watch(self, work: "Work", handles: Sequence[int]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="mpidp-dist-completion", daemon=True
                )
                self._thread.start()
        left = [len(handles)]
        lock = threading.Lock()

        def one() -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                self._queue.put(work)

        for hid in handles:
            when_done(hid, one)

    def _run(self) -> None:
        while True:
            work = self._queue.get()
            try:
                work.complete()
            except BaseException:  # complete() records the error in the future; never die
                logger.exception("completing a torch.distributed work failed")


_COMPLETIONS = _Completions()


class Work(dist.Work):
    """One torch.distributed call running on mpidp's engine: its handles, what turns their
    results into the call's output (copies into the caller's tensors), and its future.

    wait() synchronizes the handles on the calling thread (which runs the engine's cycles when
    it is idle, as mpidp's own blocking calls do); a work no one waits on is completed by the
    completion thread as soon as the engine finishes it, so get_future() completes either way.
    """

    def __init__(
        self,
        handles: List[int],
        finish: Callable[[list], List[torch.Tensor]],
        source_rank: Callable[[], int] = lambda: -1,
        pending: bool = False,
        on_error: Optional[Callable[[BaseException], None]] = None,
    ):
        super().__init__()
        self._handles = handles
        self._finish = finish
        self._source = source_rank
        self._on_error = on_error
        self._future: torch.futures.Future = torch.futures.Future()
        self._lock = threading.Lock()
        self._done = False
        self._error: Optional[BaseException] = None
        self._value: List[torch.Tensor] = []
        if handles:
            _COMPLETIONS.watch(self, handles)
        elif not pending:
            self.complete()

    def attach(self, handles: List[int]) -> None:
        """Give a work made `pending` the handles of its call's ops, once they are submitted."""
        self._handles = handles
        _COMPLETIONS.watch(self, handles)

    @classmethod
    def finished(cls, value: List[torch.Tensor], source_rank: int = -1) -> "Work":
        """A work whose call already completed (a blocking call run at once)."""
        return cls([], lambda _: value, lambda: source_rank)

    def complete(self) -> None:
        """Synchronize the handles (driving the engine if no thread does) and complete the
        future with the call's output or its error; once. Synchronization: the handles' ops."""
        with self._lock:
            if self._done:
                return
            try:
                results = self._results()
                self._value = self._finish(results)
            except BaseException as exc:  # noqa: BLE001  (the waiter re-raises it)
                self._error = exc
                if self._on_error is not None:
                    self._on_error(exc)
            self._done = True
        if self._error is not None:
            self._future.set_exception(self._error)
        else:
            self._future.set_result(self._value)

    def _results(self) -> list:
        """Wait for what the call runs (its handles' ops) and return their results."""
        return [synchronize(h) for h in self._handles]

    def wait(self, timeout=None) -> bool:
        """Block until the call completed; raise its error (mpidp's, e.g. MismatchError).
        Synchronization: the ops of the call, with every rank of the group."""
        if not self._done:  # done is set last, under the lock: the common blocking case skips it
            self.complete()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done and self._error is None

    def exception(self):
        return self._error

    def get_future(self) -> torch.futures.Future:
        return self._future

    def result(self) -> List[torch.Tensor]:
        self.wait()
        return self._value

    def source_rank(self) -> int:
        self.wait()
        return self._source()

    def _source_rank(self) -> int:
        return self.source_rank()

    def synchronize(self) -> None:
        self.wait()
