"""This rank's part in one process set: the set's world ranks, its engine, unnamed-op numbering."""

import threading


class Member:
    """This rank's part in one process set: the set's world ranks, its engine, unnamed numbering."""

    def __init__(self, set_id: int, ranks, engine, world_rank: int):
        self.set_id = set_id
        self.ranks = tuple(ranks)
        self.engine = engine
        self.rank = self.ranks.index(world_rank)
        self.size = len(self.ranks)
        self._lock = threading.Lock()
        self._noname = 0

    def auto_name(self) -> str:
        """Unnamed ops match across ranks by submission order: the k-th unnamed op is 'noname.k'."""
        with self._lock:
            self._noname += 1
            return f"noname.{self._noname}"

    def unnamed_count(self) -> int:
        return self._noname

    def resume_names(self, count: int) -> None:
        """Continue unnamed numbering from `count` (after a join, the same on every rank)."""
        with self._lock:
            self._noname = max(self._noname, count)
