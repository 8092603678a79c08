"""Where each rank's shard of a bucket's flattened parameters lies, and moving data in and out."""

from typing import List, Tuple

import torch


class Layout:
    """A bucket's parameters laid end to end (flattened, in bucket order) and cut into `size`
    equal chunks, the last padded with zeros: rank r owns elements [r * chunk, (r + 1) * chunk).
    Equal chunks make the reduce-scatter and the allgather balanced (each rank sends and
    receives the same count), so the two move what one allreduce moves."""

    def __init__(self, params: List[torch.nn.Parameter], indices: List[int], size: int, rank: int):
        self.params = params
        self.indices = indices  # each parameter's position in the wrapped optimizer's groups
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels:
            self.offsets.append(self.offsets[-1] + n)
        self.total = self.offsets[-1]
        self.size = size
        self.chunk = max(1, -(-self.total // size))
        self.padded = self.chunk * size
        self.start = rank * self.chunk
        self.stop = self.start + self.chunk

    def pieces(self, start: int, stop: int) -> List[Tuple[int, int, int, int]]:
        """(position in the bucket, first element within that parameter, first element within
        [start, stop), length) for each parameter overlapping elements [start, stop)."""
        out = []
        for i, (begin, end) in enumerate(zip(self.offsets, self.offsets[1:])):
            lo, hi = max(begin, start), min(end, stop)
            if lo < hi:
                out.append((i, lo - begin, lo - start, hi - lo))
        return out

    def own_pieces(self) -> List[Tuple[int, int, int, int]]:
        """pieces() of this rank's chunk."""
        return self.pieces(self.start, self.stop)

    def pack(self, tensors, out: torch.Tensor) -> torch.Tensor:
        """Copy `tensors` (one per parameter, None for zeros) end to end into `out` (padded
        length); the padding is zeroed."""
        for t, begin, end in zip(tensors, self.offsets, self.offsets[1:]):
            if t is None:
                out[begin:end].zero_()
            else:
                out[begin:end].copy_(t.reshape(-1))
        out[self.total :].zero_()
        return out

    def home(self, flat: torch.Tensor) -> None:
        """Move every parameter's values into `flat` (padded length; padding zeroed) and make
        the parameter a view of its place there (same Parameter object, new storage)."""
        with torch.no_grad():
            # One parameter at a time, so that its old storage is freed before the next copy:
            # the move never holds two copies of the bucket.
            for p, view in zip(self.params, self.split(flat)):
                if p.data_ptr() != view.data_ptr():
                    view.copy_(p.detach())
                    p.data = view
            flat[self.total :].zero_()

    def homed(self, flat: torch.Tensor) -> bool:
        """Whether every parameter is still the view home() made (not given new storage)."""
        base = flat.data_ptr()
        size = flat.element_size()
        return all(
            p.data_ptr() == base + begin * size and p.is_contiguous()
            for p, begin in zip(self.params, self.offsets)
        )

    def split(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """The padded bucket-long `flat` as one tensor per parameter, shaped like it."""
        return [
            flat[begin:end].view_as(p)
            for p, begin, end in zip(self.params, self.offsets, self.offsets[1:])
        ]
