"""Entry points run eagerly under torch.compile: Dynamo calls them instead of tracing the engine."""

import torch


def eager(fn):
    """`fn`, which torch.compile'd code calls as it is (a graph break) rather than tracing into
    it: the engine's threads, locks and MPI calls cannot be traced. Costs ~0.3 us a call."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return fn if disable is None else disable(fn)


def compiling() -> bool:
    """Whether torch.compile (Dynamo, compiled autograd) is tracing the caller."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())
