"""response_cache.ResponseCache: HIT/MISS/INVALID, LRU eviction, bit reuse, determinism."""

import random

import pytest

from mpidp.engine.messages import OpType, Request, Response
from mpidp.engine.response_cache import HIT, INVALID, MISS, ResponseCache


def resp(name, shape=(4,)):
    req = Request(name, OpType.ALLREDUCE, "float32", shape)
    return Response(name, OpType.ALLREDUCE, req), req.cache_key()


def put(cache, name, shape=(4,)):
    return cache.put(*resp(name, shape))


def state(cache):
    return {name: bit for name, bit in cache._by_name.items()}, cache.num_bits, len(cache)


def test_miss_then_hit():
    cache = ResponseCache(4)
    r, key = resp("a")
    assert cache.lookup("a", key) == (MISS, -1)
    assert cache.put(r, key) is None
    assert cache.lookup("a", key) == (HIT, 0)
    assert cache.response(0) == r
    assert len(cache) == 1 and cache.num_bits == 1


def test_invalid_when_metadata_changed():
    cache = ResponseCache(4)
    put(cache, "a", (4,))
    _, other_key = resp("a", (5,))
    assert cache.lookup("a", other_key) == (INVALID, 0)


def test_put_same_name_updates_in_place_and_keeps_bit():
    cache = ResponseCache(4)
    put(cache, "a", (4,))
    put(cache, "b")
    r5, key5 = resp("a", (5,))
    assert cache.put(r5, key5) is None
    assert cache.lookup("a", key5) == (HIT, 0)
    assert cache.response(0) == r5
    assert len(cache) == 2 and cache.num_bits == 2


def test_bits_are_handed_out_in_order():
    cache = ResponseCache(8)
    for i, name in enumerate("abcde"):
        put(cache, name)
        assert cache.lookup(name, resp(name)[1]) == (HIT, i)
    assert cache.num_bits == 5


def test_capacity_eviction_is_lru_by_insertion_without_touch():
    cache = ResponseCache(3)
    for name in "abc":
        assert put(cache, name) is None
    assert put(cache, "d") == 0  # 'a' was least recently used
    assert cache.lookup("a", resp("a")[1]) == (MISS, -1)
    assert cache.lookup("d", resp("d")[1]) == (HIT, 0)  # its bit is reused
    assert len(cache) == 3 and cache.num_bits == 3


def test_capacity_eviction_follows_touch_order():
    cache = ResponseCache(3)
    for name in "abc":
        put(cache, name)
    cache.touch(0)  # a
    cache.touch(1)  # b
    assert put(cache, "d") == 2  # c is now the least recently used
    assert cache.lookup("c", resp("c")[1]) == (MISS, -1)
    cache.touch(0)
    assert put(cache, "e") == 1  # order now b, d, a -> b goes
    assert cache.lookup("b", resp("b")[1]) == (MISS, -1)
    assert {n for n in "ade" if cache.lookup(n, resp(n)[1])[0] == HIT} == set("ade")


def test_put_of_existing_name_counts_as_touch():
    cache = ResponseCache(2)
    put(cache, "a")
    put(cache, "b")
    put(cache, "a")  # re-put: a becomes most recent
    assert put(cache, "c") == 1  # b evicted
    assert cache.lookup("a", resp("a")[1])[0] == HIT


def test_freed_bits_are_reused_smallest_first():
    cache = ResponseCache(10)
    for name in "abcdef":
        put(cache, name)
    for bit in (4, 1, 3):
        cache.evict(bit)
    assert len(cache) == 3 and cache.num_bits == 6
    for name, expected_bit in (("x", 1), ("y", 3), ("z", 4), ("w", 6)):
        put(cache, name)
        assert cache.lookup(name, resp(name)[1]) == (HIT, expected_bit)
    assert cache.num_bits == 7


def test_evict_forgets_name():
    cache = ResponseCache(4)
    put(cache, "a")
    cache.evict(0)
    assert cache.lookup("a", resp("a")[1]) == (MISS, -1)
    assert len(cache) == 0
    with pytest.raises(KeyError):
        cache.response(0)


def test_capacity_zero_caches_nothing():
    cache = ResponseCache(0)
    for name in "abc":
        assert put(cache, name) is None
        assert cache.lookup(name, resp(name)[1]) == (MISS, -1)
    assert len(cache) == 0 and cache.num_bits == 0


def _random_ops(seed, steps=400):
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(12)]
    ops = []
    for _ in range(steps):
        ops.append(
            (
                rng.choice(["put", "put", "touch", "evict"]),
                rng.choice(names),
                rng.choice([(4,), (5,)]),
            )
        )
    return ops


def _replay(cache, ops):
    evictions = []
    for kind, name, shape in ops:
        bit = cache._by_name.get(name)
        if kind == "put":
            evictions.append(put(cache, name, shape))
        elif bit is not None and kind == "touch":
            cache.touch(bit)
        elif bit is not None and kind == "evict":
            cache.evict(bit)
    return evictions


@pytest.mark.parametrize("seed", range(5))
def test_two_caches_fed_the_same_sequence_stay_identical(seed):
    ops = _random_ops(seed)
    a, b = ResponseCache(5), ResponseCache(5)
    assert _replay(a, ops) == _replay(b, ops)
    assert state(a) == state(b)
    assert list(a._lru) == list(b._lru)
    assert a._free == b._free
    assert len(a) <= 5
    for name, bit in a._by_name.items():
        assert a.response(bit) == b.response(bit)
        assert a.response(bit).name == name


def test_identical_after_step_by_step_comparison():
    a, b = ResponseCache(3), ResponseCache(3)
    for op in _random_ops(42, steps=200):
        _replay(a, [op])
        _replay(b, [op])
        assert state(a) == state(b)


def test_bit_vector_stays_short_under_churn():
    cache = ResponseCache(4)
    for i in range(100):
        put(cache, f"n{i}")
    assert cache.num_bits == 4
    assert len(cache) == 4
