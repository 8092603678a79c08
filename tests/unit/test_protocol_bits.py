"""The band's bit sets: Python integers in, little-endian uint64 words on the wire, and back."""

import random

import numpy as np

from mpidp.engine.protocol import _bits_int, _int_bits


def test_bits_round_trip_through_uint64_words():
    rng = random.Random(7)
    for words in (1, 2, 5):
        for _ in range(50):
            bits = sorted(rng.sample(range(64 * words), rng.randint(0, 64 * words)))
            x = _bits_int(bits)
            wire = np.frombuffer(x.to_bytes(8 * words, "little"), dtype="<u8")
            # Word w holds bits [64w, 64w + 64): what a bitwise AND across ranks relies on.
            for w in range(words):
                want = sum(1 << (b - 64 * w) for b in bits if 64 * w <= b < 64 * (w + 1))
                assert int(wire[w]) == want
            assert _int_bits(int.from_bytes(wire.tobytes(), "little")) == bits


def test_and_of_two_ranks_is_the_intersection():
    a, b = [0, 3, 64, 65, 130], [3, 5, 65, 130, 131]
    assert _int_bits(_bits_int(a) & _bits_int(b)) == [3, 65, 130]
    assert _int_bits(0) == []
