"""The order a benchmark's contenders run in, round by round: shuffled anew, alike on every rank."""

import random
from typing import List, Sequence, TypeVar

T = TypeVar("T")


def order(contenders: Sequence[T], round_index: int) -> List[T]:
    """`contenders` in the order of round `round_index`: a shuffle seeded by the round, so that
    every rank runs them in the same order (they meet in the same collectives). A rotation
    would keep each contender behind the same neighbour and let it carry that one's
    after-effects every round: in cluster_step.py the contender after "no communication" ran
    about 5 % slower, whichever it was (BENCHMARKS.md)."""
    return random.Random(round_index).sample(list(contenders), len(contenders))
