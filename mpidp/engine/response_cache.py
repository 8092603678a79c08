"""The response cache: names negotiated before get a bit, so a ready op costs one bit in an AND."""

import collections
from typing import Dict, List, Optional, Tuple

from .messages import Response

HIT, MISS, INVALID = 0, 1, 2


class ResponseCache:
    """Identical on every rank: it changes only in the engine's ordered response stream."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_name: Dict[str, int] = {}
        self._entries: Dict[int, Tuple[Response, tuple]] = {}
        self._lru: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self._free: List[int] = []
        self.num_bits = 0  # bits in use or freed; the bit vector's length

    def lookup(self, name: str, signature: tuple) -> Tuple[int, int]:
        """(HIT, bit), (MISS, -1), or (INVALID, bit) when the name is cached with other metadata."""
        bit = self._by_name.get(name)
        if bit is None:
            return MISS, -1
        return (HIT if self._entries[bit][1] == signature else INVALID), bit

    def response(self, bit: int) -> Response:
        return self._entries[bit][0]

    def touch(self, bit: int) -> None:
        self._lru.move_to_end(bit)

    def put(self, response: Response, signature: tuple) -> Optional[int]:
        """Remember a successful response; returns the bit evicted to make room, if any."""
        if self.capacity == 0:
            return None
        bit = self._by_name.get(response.name)
        if bit is not None:
            self._entries[bit] = (response, signature)
            self.touch(bit)
            return None
        evicted = None
        if len(self._entries) >= self.capacity:
            evicted = next(iter(self._lru))
            self.evict(evicted)
        if self._free:
            bit = self._free.pop()
        else:
            bit = self.num_bits
            self.num_bits += 1
        self._by_name[response.name] = bit
        self._entries[bit] = (response, signature)
        self._lru[bit] = None
        return evicted

    def evict(self, bit: int) -> None:
        response, _ = self._entries.pop(bit)
        del self._by_name[response.name]
        del self._lru[bit]
        # Reuse the smallest free bit first so the vector stays short and the same on every rank.
        self._free.append(bit)
        self._free.sort(reverse=True)

    def __len__(self) -> int:
        return len(self._entries)
