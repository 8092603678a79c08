"""Entry points run eagerly under torch.compile: Dynamo calls them instead of tracing the engine."""

import functools
import sys

import torch


def eager(fn):
    """`fn`, which torch.compile'd code calls as it is (a graph break) rather than tracing into
    it: the engine's threads, locks and MPI calls cannot be traced. Costs ~0.3 us a call.

    torch.compiler.disable imports Dynamo, 1.2 s of CPU in every process that imports mpidp: the
    disabled twin is made at the first call after something else imported Dynamo (torch.compile
    does), and until then nothing can be compiling, so `fn` is called as it is."""
    disabled = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal disabled
        if disabled is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            disabled = torch.compiler.disable(fn)
        return disabled(*args, **kwargs)

    # Dynamo reads these off a function it meets in traced code: it calls it instead of tracing.
    for attr, value in (
        ("_torchdynamo_disable", True),
        ("_torchdynamo_disable_recursive", True),
        ("_torchdynamo_orig_callable", fn),
    ):
        setattr(call, attr, value)
    return call


def compiling() -> bool:
    """Whether torch.compile (Dynamo, compiled autograd) is tracing the caller."""
    is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None)
    return bool(is_compiling and is_compiling())
