"""ShardedOptimizer stage 2's pack buffers: a few per dtype and device, reused across steps."""

from typing import Callable, Dict, List, Tuple

import torch

# Buffers per dtype and device: bucket k's packing waits for bucket k - DEPTH's reduce-scatter,
# which has had the backward of a whole bucket to finish. Memory: DEPTH buckets, whatever the
# model's size (a fresh buffer per bucket and step cost 5-10 % of a step here in page faults).
DEPTH = 2


class PackPool:
    """Buffers of the largest bucket's padded length per (dtype, device)."""

    def __init__(self, layouts, params):
        self.sizes: Dict[Tuple, int] = {}
        for layout, p in zip(layouts, params):
            key = (p.dtype, p.device)
            self.sizes[key] = max(self.sizes.get(key, 0), layout.padded)
        self.free: Dict[Tuple, List[torch.Tensor]] = {key: [] for key in self.sizes}
        self.made: Dict[Tuple, int] = {key: 0 for key in self.sizes}
        self.busy: List[Tuple[int, Tuple, torch.Tensor]] = []  # (bucket, key, buffer), oldest first

    def take(
        self, bucket: int, like: torch.Tensor, n: int, collect: Callable[[int], None]
    ) -> torch.Tensor:
        """A buffer of `n` elements for bucket index `bucket`. When DEPTH buffers of this dtype
        and device are in flight, `collect(j)` must finish the oldest bucket j holding one (wait
        for its op), whose buffer is then reused."""
        key = (like.dtype, like.device)
        if not self.free[key] and self.made[key] >= DEPTH:
            for at, (j, k, buf) in enumerate(self.busy):
                if k == key:
                    collect(j)
                    del self.busy[at]
                    self.free[key].append(buf)
                    break
        if self.free[key]:
            buf = self.free[key].pop()
        else:
            buf = torch.empty(self.sizes[key], dtype=like.dtype, device=like.device)
            self.made[key] += 1
        self.busy.append((bucket, key, buf))
        return buf[:n]

    def release_all(self) -> None:
        """Every buffer is free again (their ops are finished or failed)."""
        for _, key, buf in self.busy:
            self.free[key].append(buf)
        self.busy = []
