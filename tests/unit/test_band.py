"""The band's layout: bit sets as Python integers in, little-endian uint64 words on the wire, and
back; the express lane's band is the general one with one bit set."""

import random

import numpy as np

from mpidp.engine import band
from mpidp.engine.lane import Lane


def test_bits_round_trip_through_uint64_words():
    rng = random.Random(7)
    for words in (1, 2, 5):
        for _ in range(50):
            bits = sorted(rng.sample(range(64 * words), rng.randint(0, 64 * words)))
            x = band.bits_int(bits)
            wire = np.frombuffer(x.to_bytes(8 * words, "little"), dtype="<u8")
            # Word w holds bits [64w, 64w + 64): what a bitwise AND across ranks relies on.
            for w in range(words):
                want = sum(1 << (b - 64 * w) for b in bits if 64 * w <= b < 64 * (w + 1))
                assert int(wire[w]) == want
            assert band.int_bits(int.from_bytes(wire.tobytes(), "little")) == bits


def test_and_of_two_ranks_is_the_intersection():
    a, b = [0, 3, 64, 65, 130], [3, 5, 65, 130, 131]
    assert band.int_bits(band.bits_int(a) & band.bits_int(b)) == [3, 65, 130]
    assert band.int_bits(0) == []


def _and(x: bytes, y: bytes) -> bytes:
    return bytes(p & q for p, q in zip(x, y))


def test_and_of_packed_bands_intersects_cached_bits_and_unites_invalid_bits_and_flags():
    nb = band.part_bytes(130)
    assert nb == 24 and band.part_bytes(0) == 0 and band.part_bytes(64) == 8
    one = band.pack(nb, band.bits_int([1, 70, 129]), band.bits_int([5]), 1)
    two = band.pack(nb, band.bits_int([1, 129]), band.bits_int([66]), 8)
    assert len(one) == 2 * nb + 8
    cached, invalid, flags = band.unpack(_and(one, two))
    assert band.int_bits(cached) == [1, 129]
    assert band.int_bits(invalid) == [5, 66] and flags == 9
    assert band.unpack(one) == (band.bits_int([1, 70, 129]), band.bits_int([5]), 1)


def test_express_band_is_the_packed_band_of_its_bit_alone():
    lane = Lane()
    for bit, num_bits in ((0, 1), (9, 10), (70, 71), (70, 200), (3, 200)):
        sent = lane.band(bit, num_bits)
        assert sent == bytes(band.pack(band.part_bytes(num_bits), 1 << bit, 0, 0))
        assert band.unpack(sent) == (1 << bit, 0, 0)
        assert lane.band(bit, num_bits) is sent  # made once per bit and cache size
