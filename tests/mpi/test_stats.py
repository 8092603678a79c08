"""mpidp.stats() and stats_window(): counts of cycles, cache hits, collectives, bytes and time."""

import pytest
import torch
from mpi_util import assert_all, gather, raises_all, run_all, same_everywhere, size

import mpidp
from mpidp.runtime import observe

pytestmark = pytest.mark.timeout(120)


def _round(prefix, sizes):
    handles = [
        mpidp.allreduce_async_(torch.ones(n), name=f"{prefix}.{i}", op=mpidp.Sum)
        for i, n in enumerate(sizes)
    ]
    for h in handles:
        mpidp.synchronize(h)


def test_counts_of_a_round_trip_through_coordinator_then_cache():
    sizes = [10, 20, 30, 40]  # float32: 400 bytes in all
    observe.stats(reset=True)
    run_all(_round, "stats.a", sizes)
    first = observe.stats(reset=True)
    run_all(_round, "stats.a", sizes)
    second = observe.stats()
    for snap, what in ((first, "first"), (second, "second")):
        same_everywhere((snap["tensors"], snap["bytes"], snap["by_op"]), f"{what} round counts")
        assert_all(
            snap["tensors"] == 4 and snap["bytes"] == 400,
            f"{what} round: {snap['tensors']} tensors, {snap['bytes']} bytes",
        )
        assert_all(
            1 <= snap["collectives"] <= 4
            and snap["tensors_per_collective"] == 4 / snap["collectives"],
            f"{what} round: {snap}",
        )
        assert_all(
            snap["by_op"]
            == {"allreduce": {"collectives": snap["collectives"], "tensors": 4, "bytes": 400}},
            str(snap),
        )
        assert_all(
            snap["collective_s"] > 0 and snap["negotiate_s"] > 0 and snap["cycles"] >= 1, str(snap)
        )
        assert_all(
            snap["params"]
            == {
                "fusion_threshold_bytes": mpidp.runtime.world.state().config.fusion_threshold_bytes,
                "fuse_below_bytes": mpidp.runtime.world.state().config.fuse_below_bytes,
                "cycle_time_ms": mpidp.runtime.world.state().config.cycle_time_ms,
            },
            str(snap["params"]),
        )
    # New names go through the coordinator; the same names again are answered by the cache.
    assert_all(
        first["cache_misses"] == 4 and first["cache_hits"] == 0 and first["slow_cycles"] >= 1,
        f"first round: {first}",
    )
    assert_all(second["cache_hits"] == 4 and second["cache_misses"] == 0, f"second: {second}")


def test_reset_returns_the_old_values_and_counts_from_zero_after():
    run_all(_round, "stats.b", [5])
    before = observe.stats(reset=True)
    after = observe.stats()
    assert_all(
        before["tensors"] >= 1 and after["tensors"] == 0 and after["bytes"] == 0,
        f"before {before['tensors']}, after {after['tensors']}",
    )
    assert_all(after["wall_s"] < before["wall_s"], f"{after['wall_s']} {before['wall_s']}")
    run_all(_round, "stats.b", [5])
    assert_all(
        observe.stats()["tensors"] == 1 and observe.stats()["bytes"] == 20, str(observe.stats())
    )


def test_other_collectives_are_counted_per_op():
    observe.stats(reset=True)

    def ops():
        mpidp.allgather(torch.ones(2, 3), name="stats.ag")
        mpidp.broadcast(torch.ones(4, dtype=torch.float64), root_rank=0, name="stats.bc")
        mpidp.barrier()

    run_all(ops)
    by_op = observe.stats()["by_op"]
    assert_all(
        by_op.get("allgather") == {"collectives": 1, "tensors": 1, "bytes": 24}
        and by_op.get("broadcast") == {"collectives": 1, "tensors": 1, "bytes": 32}
        and by_op.get("barrier", {}).get("bytes") == 0,
        str(by_op),
    )


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float32],
    ids=lambda d: str(d).replace("torch.", ""),
)
def test_wire_bytes_are_the_width_the_values_travel_in(dtype):
    """16-bit floats travel as 16 bits: reductions of them (allreduce alone, fused, chunked past
    chunk_bytes, reducescatter) put two bytes an element on the wire, not float32's four."""
    n, width = size(), torch.tensor([], dtype=dtype).element_size()
    big = (4 * 1024 * 1024) // width + 3  # more than the default chunk_bytes: chunked
    observe.stats(reset=True)

    def ops():
        mpidp.allreduce(torch.ones(1000, dtype=dtype), name=f"stats.wire.{dtype}.one")
        mpidp.grouped_allreduce(
            [torch.ones(10, dtype=dtype), torch.ones(7, dtype=dtype)],
            name=f"stats.wire.{dtype}.group",
        )
        out = mpidp.allreduce(
            torch.ones(big, dtype=dtype), op=mpidp.Sum, name=f"stats.wire.{dtype}.big"
        )
        rs = mpidp.reducescatter(
            torch.ones(2 * n, 3, dtype=dtype), op=mpidp.Sum, name=f"stats.wire.{dtype}.rs"
        )
        return bool((out == n).all() and (rs == n).all() and out.dtype == rs.dtype == dtype)

    right = run_all(ops)
    snap = observe.stats()
    elements = 1000 + 17 + big + 6 * n
    assert_all(right, "16-bit results wrong")
    assert_all(
        snap["bytes"] == elements * width and snap["wire_bytes"] == elements * width,
        f"{dtype}: {elements} elements of {width} bytes: bytes {snap['bytes']}, "
        f"wire_bytes {snap['wire_bytes']}",
    )


def test_fp16_compression_halves_the_wire_bytes_of_a_training_step():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(30, 20), torch.nn.ReLU(), torch.nn.Linear(20, 4))
    elements = sum(p.numel() for p in model.parameters())
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=mpidp.Compression.fp16,
    )

    def step():
        opt.zero_grad()
        model(torch.randn(8, 30)).sum().backward()
        opt.step()

    run_all(step)  # the first step negotiates through the coordinator
    observe.stats(reset=True)
    run_all(step)
    snap = observe.stats()
    assert_all(
        snap["wire_bytes"] == 2 * elements,
        f"one step of {elements} float32 gradients compressed to fp16 put "
        f"{snap['wire_bytes']} bytes on the wire, not {2 * elements}",
    )


def test_window_gives_comm_fraction_of_the_steps_inside_it():
    big = torch.ones(1 << 20)

    def steps():
        with observe.stats_window() as w:
            for _ in range(3):
                mpidp.allreduce_(big, name="stats.win", op=mpidp.Sum)
        return w

    w = run_all(steps)
    assert_all(w.stats["tensors"] == 3 and w.stats["bytes"] == 3 * 4 * (1 << 20), str(w.stats))
    assert_all(
        0 < w.comm_fraction <= 1.0 and 0 <= w.negotiate_fraction <= 1.0,
        f"comm {w.comm_fraction}, negotiate {w.negotiate_fraction}",
    )
    assert_all(abs(w.comm_fraction - w.stats["collective_s"] / w.wall_s) < 1e-12, "formula")


def test_window_must_be_closed_before_it_is_read():
    w = observe.stats_window()
    exc = raises_all(RuntimeError, lambda: w.comm_fraction)
    assert exc is not None
    raises_all(RuntimeError, w.stop)
    w.start()
    raises_all(RuntimeError, lambda: w.comm_fraction)
    w.stop()
    assert_all(w.comm_fraction >= 0.0, "closed window")


def test_process_set_lookup():
    from mpidp.runtime import world

    assert_all(
        observe._engine(0) is world.state().engine
        and observe._engine(None) is world.state().engine,
        "global set by id",
    )
    raises_all(ValueError, observe.stats, process_set=12345)
    counts = gather(observe.stats()["cycles"])
    assert_all(all(c > 0 for c in counts), str(counts))
