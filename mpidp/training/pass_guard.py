"""DistributedOptimizer's backward passes: one too many refused, the end, later user hooks."""

import functools
import threading
import weakref
from typing import Callable, Dict, List, Optional

import torch

from ..ops.eager import compiling

# Both refusals' remedy when the pass came from another optimizer's loss (a GAN).
OTHER_BACKWARD = (
    "If the pass was another optimizer's (a GAN generator's loss reaching the "
    "discriminator), run that backward inside `with optimizer.no_sync():` of this "
    "optimizer, or with requires_grad=False on these parameters"
)


def too_many_passes(name: str, passes: int, overlapping: bool) -> RuntimeError:
    """The error for parameter `name` getting a gradient after its `passes` of this step."""
    where = (
        "was submitted for reduction"
        if overlapping
        else "was complete (it has been added to .grad all the same)"
    )
    return RuntimeError(
        f"DistributedOptimizer: parameter {name!r} got a gradient from another backward pass "
        f"after its gradient {where} (after {passes} backward pass(es) and before "
        f"optimizer.step()). Call optimizer.step() or optimizer.synchronize() before the next "
        f"backward pass, or accumulate passes with DistributedOptimizer("
        f"backward_passes_per_step=N). {OTHER_BACKWARD}"
    )


# Graph task (a backward pass) -> (creation number, callback) of each optimizer it reached. A
# pass that failed leaves its entries here, never to be run with another's.
_ending: Dict[int, list] = {}
_ending_lock = threading.Lock()


def at_backward_end(seq: int, callback: Callable) -> bool:
    """Call `callback` when the backward pass now running (this is called from its hooks)
    ends, after every gradient of it has been accumulated (autograd's final callbacks). The
    callbacks of every optimizer the pass reached run in the optimizers' creation order `seq`,
    the same on every rank whatever order each rank's gradients came in: each waits for its
    reductions. False where there are no final callbacks: compiled autograd traces the hooks,
    and has them only with fullgraph=True."""
    if compiling():
        return False
    task = _graph_task()
    with _ending_lock:
        _ending.setdefault(task, []).append((seq, callback))
    torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_end_all, task))
    return True


def _graph_task() -> int:
    current = getattr(torch._C, "_current_graph_task_id", None)
    return current() if current is not None else 0


def _end_all(task: int) -> None:
    """The first of the pass's final callbacks runs every optimizer's, in creation order."""
    with _ending_lock:
        ending = sorted(_ending.pop(task, ()), key=lambda item: item[0])
    for _, callback in ending:
        callback()


def after_outer_node(seq: int, callback: Callable) -> bool:
    """If the backward pass whose final callback runs now is nested in another's node (a
    reentrant checkpoint's backward inside the outer one), have at_backward_end(seq, callback)
    called for the outer pass once that node is done, and say True; else False."""
    current = getattr(torch._C, "_current_autograd_node", None)
    node = current() if current is not None else None
    if node is None:
        return False
    node.register_hook(lambda *_: at_backward_end(seq, callback) and None)
    return True


def hooked_after(p: torch.nn.Parameter, own: Optional[int]) -> bool:
    """Whether `p` has a post-accumulate-grad hook registered after the optimizer's (handle id
    `own`), which runs once that one returns and may still change p.grad: its bucket then
    waits for the end of backward (or step()) instead of leaving now. The bucket's other
    parameters' later hooks ran already (each runs right after the optimizer's, on that
    parameter)."""
    hooks = p._post_accumulate_grad_hooks  # torch's own ordered table of them
    return bool(hooks) and next(reversed(hooks)) != own


def held_by_a_later_hook(name: str) -> str:
    """The warning, once per optimizer, that such a hook on parameter `name` holds buckets."""
    return (
        f"DistributedOptimizer: {name} has a post-accumulate-grad hook registered after the "
        f"optimizer's, which may still change its gradient, so its bucket (and any other so "
        f"hooked) is reduced at the end of backward, not during it; register such hooks "
        f"before wrapping the optimizer to keep the overlap"
    )


def weak(method: Callable) -> Callable:
    """`method` (bound) called through a weak reference: the hooks it is registered as, which
    the parameters hold, do not keep its optimizer alive after the script drops it."""
    ref = weakref.WeakMethod(method)

    def call(*args):
        target = ref()
        return None if target is None else target(*args)

    return call


class Guards:
    """While buckets are submitted during backward, a gradient too many must be refused before
    torch adds it to a .grad whose reduction may be in flight: a tensor hook per parameter,
    which costs backward 0.4-1 ms on ResNet-18 here (it wraps every gradient for Python).
    Without overlap nothing is in flight, and the accumulate hook refuses it afterwards, as
    Horovod does; then no tensor hook is registered."""

    def __init__(self, params: List[torch.nn.Parameter], check: Callable):
        self.params, self.check = params, weak(check)
        self.handles: list = []
        self.on = False

    def set(self, overlapping: bool) -> None:
        """Register the tensor hooks (`check(p, grad)` each) while overlapping; else remove."""
        self.on = bool(overlapping)
        if self.on and not self.handles:
            self.handles = [p.register_hook(functools.partial(self.check, p)) for p in self.params]
        elif not self.on:
            for handle in self.handles:
                handle.remove()
            self.handles = []

    def reset(self, params: List[torch.nn.Parameter]) -> None:
        """Guard `params` instead, registered if the old ones were."""
        on = self.on
        self.set(False)
        self.params = params
        self.set(on)
