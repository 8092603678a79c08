"""A short soak (benchmarks/soak.py): thousands of engine cycles of mixed ops with every result
checked on every rank. Memory growth is the benchmark's business, not asserted here."""

import re

import pytest

from .launch import ROOT, run


@pytest.mark.parametrize("n", [2, 3])
def test_short_soak_has_no_wrong_result(n):
    res = run(
        n,
        ROOT / "benchmarks" / "soak.py",
        "--cycles",
        1500,
        "--warmup-cycles",
        150,
        "--join-every",
        10,
        "--no-rss-check",
        timeout=400,
    )
    assert res.returncode == 0, res.output
    (rounds,) = re.findall(rf"^mpidp soak: {n} ranks, (\d+) rounds", res.stdout, re.M)
    lines = re.findall(
        r"^rank (\d+): (\d+) cycles, (\d+) ops, (\d+) joins .* "
        r"(\d+) wrong results: (\w+)$",
        res.stdout,
        re.M,
    )
    assert sorted(int(r) for r, *_ in lines) == list(range(n)), res.output
    for rank, cycles, ops, joins, wrong, verdict in lines:
        assert int(wrong) == 0 and verdict == "PASS", res.output
        assert int(cycles) >= 1500 and int(ops) > 10 * int(rounds), res.output
        # The join() rounds ran: every rank joined once per 10 rounds.
        assert int(joins) == int(rounds) // 10 > 0, res.output
