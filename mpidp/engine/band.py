"""The band's byte layout: cache bits, invalid bits and flags, ANDed across ranks each cycle.

protocol.py states what the parts mean (step 2 of its docstring). Each bit part is `part_bytes`
long, whole uint64 words little-endian, then one word of flags. The invalid bits and the flags
are sent complemented, so that the AND across ranks is an OR for them. The band is built and
read as Python integers and bytes: numpy's pack/unpack calls cost more than the band allreduce
itself for the few bits a cycle carries.
"""

from typing import Iterable, List, Tuple, Union

_MASK64 = (1 << 64) - 1


def bits_int(bits: Iterable[int]) -> int:
    """The integer with `bits` set."""
    x = 0
    for bit in bits:
        x |= 1 << bit
    return x


def int_bits(x: int) -> List[int]:
    """The set bits of `x`, lowest first."""
    out = []
    while x:
        low = x & -x
        out.append(low.bit_length() - 1)
        x ^= low
    return out


def part_bytes(num_bits: int) -> int:
    """Bytes in each bit part of the band of a response cache of `num_bits` bits."""
    return 8 * ((num_bits + 63) // 64)


def pack(nb: int, cached: int, invalid: int, flags: int) -> bytearray:
    """The band with bit parts of `nb` bytes: the bits of `cached`, of `invalid`, and `flags`."""
    full = (1 << (8 * nb)) - 1
    return bytearray(
        cached.to_bytes(nb, "little")
        + (full ^ invalid).to_bytes(nb, "little")
        + (_MASK64 ^ flags).to_bytes(8, "little")
    )


def unpack(band: Union[bytes, bytearray]) -> Tuple[int, int, int]:
    """(cached, invalid, flags) of a band as pack() made it: after the AND, the bits cached on
    every rank, the bits some rank found invalid and the flags some rank raised."""
    nb = (len(band) - 8) // 2
    full = (1 << (8 * nb)) - 1
    return (
        int.from_bytes(band[:nb], "little"),
        full ^ int.from_bytes(band[nb : 2 * nb], "little"),
        _MASK64 ^ int.from_bytes(band[2 * nb :], "little"),
    )
