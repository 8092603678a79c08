"""One bucket's memory on a ShardedOptimizer rank: its parameters, shard and gradient buffers."""

from typing import List, Optional, Sequence

import torch

from .layout import Layout

# The wrapped optimizer steps a shard as pieces of at most this many bytes. torch's foreach
# optimizers make temporaries as large as each tensor, and large ones are returned to the OS
# when freed, so every step page-faults them in again: Adam over 5.6 M float32 elements took
# 7.5 ms in 1 MiB pieces, 9.9 ms in 4 MiB, 18-22 ms in 8 MiB and more (BENCHMARKS.md).
PIECE_BYTES = 1 << 20


class ShardBuffers:
    """Bucket `layout`'s parameters moved into one buffer (`home`, each parameter a view of its
    place there), this rank's `shard` of it as the wrapped optimizer's `pieces`, the shard's
    averaged gradient (`reduced`) and, for stage 1, the parameters' gradients (`flat`)."""

    def __init__(self, layout: Layout, first: torch.Tensor):
        self.layout = layout
        self.home = torch.zeros(layout.padded, dtype=first.dtype, device=first.device)
        layout.home(self.home)
        self.shard = self.home[layout.start : layout.stop]
        self._piece = max(1, PIECE_BYTES // first.element_size())
        self.pieces: List[torch.Tensor] = list(self.shard.split(self._piece))
        self.reduced: Optional[torch.Tensor] = None  # a fresh one per step would page-fault
        self._reduced_pieces: List[torch.Tensor] = []
        self.flat: Optional[torch.Tensor] = None
        self.views: Optional[List[torch.Tensor]] = None

    def reduced_buffer(self) -> torch.Tensor:
        """Where the shard's reduce-scatter lands, the same tensor every step."""
        if self.reduced is None:
            self.reduced = torch.empty_like(self.shard)
            self._reduced_pieces = list(self.reduced.split(self._piece))
        return self.reduced

    def set_grad(self, grad: Optional[torch.Tensor]) -> None:
        """Give the shard and its pieces their gradient (views of `grad`), or none."""
        self.shard.grad = grad
        parts: Sequence[Optional[torch.Tensor]]
        if grad is None:
            parts = [None] * len(self.pieces)
        elif grad is self.reduced:
            parts = self._reduced_pieces
        else:
            parts = list(grad.split(self._piece))
        for piece, part in zip(self.pieces, parts):
            piece.grad = part

    def grad_views(self) -> List[torch.Tensor]:
        """Stage 1: the parameters' gradient buffer (made on first use), a view per parameter."""
        if self.views is None:
            self.flat = torch.zeros_like(self.home)
            self.views = self.layout.split(self.flat)
        return self.views

    def move_grad(self, p: torch.nn.Parameter, j: int) -> None:
        """Stage 1: move the gradient backward just gave parameter `p` (the bucket's j-th) into
        its place in the buffer, which becomes its .grad: later backward passes accumulate
        there, and the fresh tensor is freed at once rather than at submission."""
        grad = p.grad
        if grad is not None and not grad.is_sparse:
            view = self.grad_views()[j]
            if grad is not view:
                view.copy_(grad)
                p.grad = view

    def fill(self, params, grads) -> torch.Tensor:
        """Stage 1: the buffer holding `grads` (dense, one per parameter, None for zeros), each
        parameter's .grad a view of its place; returns the buffer."""
        for p, g, view in zip(params, grads, self.grad_views()):
            if g is view:
                continue  # moved there by move_grad, or accumulated there
            if g is None:
                view.zero_()
            else:
                view.copy_(g)
            p.grad = view
        assert self.flat is not None  # grad_views() made it
        return self.flat

    def rehome(self) -> None:
        """Move back into `home` any parameter a script gave new storage (p.data = ...)."""
        if not self.layout.homed(self.home):
            self.layout.home(self.home)
