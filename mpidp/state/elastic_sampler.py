"""ElasticSampler: shards a data set across ranks and remembers how far the epoch has got.

A resumed run (mpidp.elastic) continues mid-epoch without repeating or skipping samples, even on
a new world size. For a bitwise repeat, give a DataLoader its own `generator=torch.Generator()`:
otherwise every new iterator draws a seed from torch's global generator, and a resumed epoch
makes one more iterator than the uninterrupted run did.
"""

import math
from typing import Dict, Iterator, Optional

import torch

from ..runtime import world


class ElasticSampler(torch.utils.data.Sampler):
    """Shards `dataset` across ranks and remembers how much of the epoch has been processed.

    Each epoch's order is a permutation seeded by `seed + epoch` (the identity without
    `shuffle`), the same on every rank. The samples not yet processed are dealt out round-robin:
    rank r takes the r-th, (r+n)-th, ... of them, so after every rank has done k batches of b
    samples, exactly the first k*b*n samples of the order are done. `record_batch` notes that;
    `state_dict()` saves it, and after `load_state_dict()` the sampler yields only what is left,
    sharded over the current number of ranks. Without `drop_last`, the last round is padded with
    samples from the start of the epoch's order so every rank yields as many samples.
    `set_epoch(e)` starts epoch e from its beginning, unless e is already the current epoch (so a
    loop that calls it at the top of each epoch keeps a resumed position).
    """

    def __init__(
        self,
        dataset,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
    ):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self._replicas_arg = num_replicas
        self._rank_arg = rank
        self.epoch = 0
        self.processed = 0  # samples of this epoch's order done by all ranks together
        self._base = 0  # `processed` when the current shard was dealt
        self.reset()

    def reset(self) -> None:
        """Deal the unprocessed samples out again (after a load or a change of world size)."""
        self.num_replicas = self._replicas_arg or world.size()
        self.rank = world.rank() if self._rank_arg is None else self._rank_arg
        n = len(self.dataset)
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(n, generator=generator).tolist()
        else:
            order = list(range(n))
        self._base = min(self.processed, n)
        remaining = order[self._base :]
        if self.drop_last:
            total = len(remaining) // self.num_replicas * self.num_replicas
            remaining = remaining[:total]
        else:
            total = math.ceil(len(remaining) / self.num_replicas) * self.num_replicas
            pad = total - len(remaining)
            # From the head of the full order: a resumed epoch pads exactly as an uninterrupted one.
            remaining = remaining + [order[i % n] for i in range(pad)]
        self._remaining = len(order) - self._base
        self._order = order
        self._local = 0  # samples this rank has recorded since this deal
        self.indices = remaining[self.rank : total : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning; no change if it is already the current epoch."""
        if epoch != self.epoch:
            self.epoch = epoch
            self.processed = 0
            self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Every rank has finished its batches 0..batch_idx (of `batch_size` samples per rank)
        since the last reset (a load, a new epoch): the loader's own batch index will do."""
        self._record((batch_idx + 1) * batch_size)

    def record_indices(self, indices) -> None:
        """Every rank has finished as many more samples as `indices` (this rank's) holds, as
        Horovod's record_indices after get_indices; ranks record in step."""
        self._record(self._local + len(indices))

    def _record(self, local: int) -> None:
        self._local = local
        self.processed = self._base + min(local * self.num_replicas, self._remaining)

    def get_indices(self, batch_idx: int, batch_size: int):
        """This rank's data-set indices of batch `batch_idx` (of `batch_size`) since the last
        reset."""
        return self.indices[batch_idx * batch_size : (batch_idx + 1) * batch_size]

    @property
    def processed_indices(self):
        """The data-set indices of this epoch that every rank together has processed."""
        return set(self._order[: self.processed])

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed": self.processed, "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        self.epoch = int(state["epoch"])
        self.processed = int(state["processed"])
        self.seed = int(state.get("seed", self.seed))
        self.reset()

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)
