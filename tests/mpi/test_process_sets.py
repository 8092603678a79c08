"""Process sets: static and dynamic registration, every collective's process_set=, the optimizer."""

import gc
import os
import time

import pytest
import torch
from mpi4py import MPI
from mpi_util import assert_all, gather, raises_all, run_all

import mpidp

pytestmark = pytest.mark.mpi(min_size=2)


def _world():
    return MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()


@pytest.fixture
def evens_odds():
    """Two disjoint dynamic sets (even ranks, odd ranks), removed after the test."""
    rank, size = _world()
    evens = mpidp.add_process_set(list(range(0, size, 2)))
    odds = mpidp.add_process_set(mpidp.ProcessSet(list(range(1, size, 2))))
    yield evens, odds
    mpidp.remove_process_set(odds)
    mpidp.remove_process_set(evens)


def _mine(evens, odds):
    rank, _ = _world()
    return (evens, odds) if rank % 2 == 0 else (odds, evens)


def test_set_queries(evens_odds):
    evens, odds = evens_odds
    rank, size = _world()
    mine, other = _mine(evens, odds)

    def check():
        assert mine.included() and not other.included()
        assert mine.ranks == list(range(rank % 2, size, 2))
        assert mine.size() == len(mine.ranks)
        assert mine.rank() == mine.ranks.index(rank)
        assert mpidp.global_process_set.ranks == list(range(size))
        assert mpidp.global_process_set.process_set_id == 0
        assert evens.process_set_id != odds.process_set_id
        with pytest.raises(ValueError, match="not in process set"):
            other.rank()

    run_all(check)


@pytest.mark.parametrize("op", [mpidp.Sum, mpidp.Average, mpidp.Max])
def test_allreduce_reduces_over_members_only(evens_odds, op, device):
    rank, size = _world()
    mine, _ = _mine(*evens_odds)
    x = torch.full((5,), float(rank + 1), device=device)
    out = run_all(mpidp.allreduce, x, name=f"ps.allreduce.{device.type}", op=op, process_set=mine)
    vals = [r + 1.0 for r in mine.ranks]
    expected = {mpidp.Sum: sum(vals), mpidp.Average: sum(vals) / len(vals), mpidp.Max: max(vals)}[
        op
    ]
    assert_all(
        out.device == device and torch.allclose(out, torch.full((5,), expected, device=device)),
        f"{out} != {expected} on {device}",
    )


def test_unnamed_ops_in_sets_and_world_interleave(evens_odds):
    rank, size = _world()
    mine, _ = _mine(*evens_odds)
    outs = []

    def body():
        # Members of different sets submit different numbers of unnamed set ops; global unnamed
        # numbering must not be shifted by them.
        for _ in range(1 + rank % 2):
            outs.append(mpidp.allreduce(torch.ones(2), op=mpidp.Sum, process_set=mine))
        outs.append(mpidp.allreduce(torch.ones(2), op=mpidp.Sum))

    run_all(body)
    ok = all(o.tolist() == [float(mine.size())] * 2 for o in outs[:-1])
    assert_all(ok and outs[-1].tolist() == [float(size)] * 2, [o.tolist() for o in outs])


def test_other_collectives_in_a_set(evens_odds, device):
    rank, size = _world()
    mine, _ = _mine(*evens_odds)
    members = mine.ranks
    k, me = len(members), mine.rank()
    d = device.type

    def full(shape, value):
        return torch.full(shape, value, device=device)

    def body():
        got = {}
        got["allgather"] = mpidp.allgather(
            full((me + 1, 2), float(rank)), name=f"ps.ag.{d}", process_set=mine
        )
        got["bcast"] = mpidp.broadcast(
            full((3,), float(rank)), root_rank=members[-1], name=f"ps.bc.{d}", process_set=mine
        )
        got["alltoall"] = mpidp.alltoall(
            full((k,), float(rank)), name=f"ps.a2a.{d}", process_set=mine
        )
        got["rs"] = mpidp.reducescatter(
            full((k * 2, 3), 1.0), op=mpidp.Sum, name=f"ps.rs.{d}", process_set=mine
        )
        got["obj"] = mpidp.broadcast_object({"from": rank}, root_rank=members[0], process_set=mine)
        got["objs"] = mpidp.allgather_object(rank, process_set=mine)
        mpidp.barrier(process_set=mine)
        return got

    got = run_all(body)
    expected_ag = torch.cat([full((i + 1, 2), float(r)) for i, r in enumerate(members)])
    checks = [
        torch.equal(got["allgather"], expected_ag),
        torch.equal(got["bcast"], full((3,), float(members[-1]))),
        torch.equal(got["alltoall"], torch.tensor([float(r) for r in members], device=device)),
        torch.equal(got["rs"], full((2, 3), float(k))),
        got["obj"] == {"from": members[0]},
        got["objs"] == members,
    ]
    assert_all(all(checks), f"{checks}")


def test_ops_on_a_set_this_rank_is_not_in_are_refused(evens_odds):
    _, other = _mine(*evens_odds)
    raises_all(
        ValueError, mpidp.allreduce, torch.ones(1), process_set=other, match="is not in process set"
    )


def test_broadcast_root_outside_the_set_is_refused(evens_odds):
    mine, other = _mine(*evens_odds)
    raises_all(
        ValueError,
        mpidp.broadcast,
        torch.ones(1),
        root_rank=other.ranks[0],
        process_set=mine,
        match="root_rank is a global rank and must be a member",
    )


def test_alltoall_splits_count_the_set_not_the_world(evens_odds):
    rank, size = _world()
    mine, _ = _mine(*evens_odds)
    if mine.size() == size:
        pytest.skip("set as large as the world")
    raises_all(
        ValueError,
        mpidp.alltoall,
        torch.ones(size),
        splits=[1] * size,
        process_set=mine,
        match=f"there are {mine.size()} ranks",
    )


def test_sets_and_world_run_concurrently(evens_odds):
    rank, size = _world()
    mine, _ = _mine(*evens_odds)

    def body():
        handles = []
        for i in range(10):
            handles.append(
                mpidp.allreduce_async(torch.full((100,), 1.0), name=f"w.{i}", op=mpidp.Sum)
            )
            handles.append(
                mpidp.allreduce_async(
                    torch.full((100,), 1.0), name=f"s.{i}", op=mpidp.Sum, process_set=mine
                )
            )
        return [mpidp.synchronize(h)[0].item() for h in handles]

    vals = run_all(body)
    assert_all(vals == [float(size), float(mine.size())] * 10, vals)


def test_each_set_keeps_its_own_stats(evens_odds):
    mine, other = _mine(*evens_odds)
    before = run_all(mpidp.stats, process_set=mine)["collectives"]
    run_all(mpidp.allreduce, torch.ones(3), name="ps.stats", process_set=mine)
    after = mpidp.stats(process_set=mine)["collectives"]
    assert_all(after == before + 1, f"set collectives {before} -> {after}")
    raises_all(ValueError, mpidp.stats, process_set=other, match="is not in process set")


def test_a_sets_process_group_is_set_up_through_the_worlds_store(evens_odds):
    """Under MPIDP_BACKEND=gloo a set's group is set up through the world's store, under a
    prefix of its own: no new store connection, each of which may wait 5 s for a reverse name
    lookup (engine/backends/torchdist.py, open_group). On MPI's path neither has a store."""
    from mpidp.runtime import world

    mine, _ = _mine(*evens_odds)
    st = world.state()
    ours = st.members[0].engine.backend.group_store()
    theirs = st.members[mine.process_set_id].engine.backend.group_store()
    gloo = st.config.backend == "gloo"
    ok = theirs is ours and (ours is not None) == gloo
    assert_all(ok, f"backend {st.config.backend}: world store {ours!r}, set store {theirs!r}")
    out = run_all(mpidp.allreduce, torch.ones(2), name="ps.store", process_set=mine, op=mpidp.Sum)
    assert_all(out.tolist() == [float(mine.size())] * 2, f"allreduce on the set: {out}")


def test_removing_sets_frees_their_groups_without_the_cycle_collector():
    """A removed set's engine ends its stall watch and lets go of its data path's process group
    at once (under gloo the group's threads end with it), also in a process whose cycle
    collector never runs (here: disabled) or that froze its objects with gc.freeze(): the test
    processes of the gloo stage held about 80 such threads each after test_process_sets.py."""

    def threads():
        return len(os.listdir("/proc/self/task"))

    _, size = _world()
    run_all(mpidp.allreduce, torch.ones(1), name="ps.free.warm", op=mpidp.Sum)
    gc.collect()
    gc.disable()
    try:
        before = threads()
        for i in range(4):
            sets = [mpidp.add_process_set(list(range(r, size, 2))) for r in range(min(size, 2))]
            for ps in sets:
                if mpidp.rank() in ps.ranks:
                    run_all(
                        mpidp.allreduce,
                        torch.ones(1),
                        name=f"ps.free.{i}",
                        op=mpidp.Sum,
                        process_set=ps,
                    )
            for ps in sets:
                mpidp.remove_process_set(ps)
        # A joined thread's task may linger for a moment after Python's join() returned.
        deadline = time.monotonic() + 0.5
        while threads() > before and time.monotonic() < deadline:
            time.sleep(0.01)
        after = threads()
    finally:
        gc.enable()
    assert_all(after <= before, f"threads: {before} before 4 rounds of sets, {after} after")


def test_distributed_optimizer_on_a_set(evens_odds, device):
    rank, size = _world()
    mine, _ = _mine(*evens_odds)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).to(device)
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        named_parameters=model.named_parameters(),
        process_set=mine,
    )
    data = torch.full((3, 4), float(rank), device=device)

    def step():
        opt.zero_grad()
        model(data).pow(2).sum().backward()
        opt.step()

    for _ in range(2):
        run_all(step)
    # Members of a set hold identical parameters; the two sets saw different data.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    views = gather(flat.tolist())
    same = all(views[r] == views[mine.ranks[0]] for r in mine.ranks)
    differ = views[0] != views[1]
    assert_all(same and differ, "set members diverged, or the sets were reduced together")


def test_broadcast_optimizer_state_within_a_set(evens_odds):
    """Each set copies its first member's Adam state to its other members, and only them."""
    rank, _ = _world()
    mine, _ = _mine(*evens_odds)
    model = torch.nn.Linear(3, 2)
    opt = mpidp.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=0.1 + rank),
        named_parameters=model.named_parameters(),
        process_set=mine,
    )
    model(torch.full((2, 3), float(rank))).sum().backward()
    opt._opt.step()  # local state that differs by rank
    run_all(mpidp.broadcast_optimizer_state, opt, root_rank=mine.ranks[0], process_set=mine)
    state = opt.state_dict()
    mine_avg = [v["exp_avg"].tolist() for _, v in sorted(state["state"].items())]
    views = gather((state["param_groups"][0]["lr"], mine_avg))
    ok = all(views[r] == views[mine.ranks[0]] for r in mine.ranks) and views[0] != views[1]
    assert_all(ok, views)


def test_distributed_optimizer_outside_its_set_steps_on_local_gradients(evens_odds):
    """As in Horovod: on a rank outside the set the optimizer hooks nothing, synchronize() does
    nothing and step() applies this rank's own gradients; the members reduce among themselves."""
    evens, _ = evens_odds
    rank, _ = _world()
    torch.manual_seed(0)
    model, ref = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    ref.load_state_dict(model.state_dict())
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.5),
        named_parameters=model.named_parameters(),
        process_set=evens,
    )
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    data = torch.full((3, 4), float(rank + 1))

    def step():
        opt.zero_grad()
        model(data).pow(2).sum().backward()
        opt.synchronize()
        with opt.skip_synchronize():
            opt.step()
        ref_opt.zero_grad()
        ref(data).pow(2).sum().backward()
        ref_opt.step()

    for _ in range(2):
        run_all(step)
    local = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    hooks = len(opt._hooks)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    views = gather(flat)
    if rank % 2:
        ok, msg = local and hooks == 0, f"outside: local step {local}, {hooks} hooks"
    else:
        members = [r for r in range(len(views)) if r % 2 == 0]
        same = all(views[r] == views[0] for r in members)
        ok = same and (len(members) == 1 or not local)
        msg = f"members identical {same}, equal to a local step {local}"
    assert_all(ok, msg)


def test_ranks_that_disagree_fail_every_rank():
    rank, size = _world()
    ranks = [0, 1] if rank == 0 else [0, size - 1] if size > 2 else [1]
    raises_all(ValueError, mpidp.add_process_set, ranks, match="ranks disagree")


@pytest.mark.parametrize(
    "ranks, match", [([], "at least one"), ([0, 0], "distinct"), ([0, 99], "distinct ranks in 0..")]
)
def test_bad_rank_lists_are_refused_everywhere(ranks, match):
    raises_all(ValueError, mpidp.add_process_set, ranks, match=match)


def test_duplicate_set_and_global_removal_are_refused():
    _, size = _world()
    ps = run_all(mpidp.add_process_set, [1])
    try:
        raises_all(ValueError, mpidp.add_process_set, mpidp.ProcessSet([1]), match="already exists")
        raises_all(ValueError, mpidp.add_process_set, list(range(size)), match="already exists")
        raises_all(
            ValueError,
            mpidp.remove_process_set,
            mpidp.global_process_set,
            match="cannot be removed",
        )
    finally:
        run_all(mpidp.remove_process_set, ps)
    raises_all(ValueError, mpidp.allreduce, torch.ones(1), process_set=ps, match="not registered")


def test_set_from_a_communicator():
    rank, size = _world()
    members = list(range(size - 1))
    comm = MPI.COMM_WORLD.Split(color=0 if rank in members else MPI.UNDEFINED, key=rank)
    ps = run_all(mpidp.add_process_set, mpidp.ProcessSet(comm))
    try:
        assert_all(ps.ranks == members, ps.ranks)
        if rank in members:
            out = run_all(mpidp.allreduce, torch.ones(1), op=mpidp.Sum, process_set=ps)
            ok = out.item() == len(members)
        else:
            run_all(lambda: None)  # stays in step with the members' collective assertion
            ok = True
        assert_all(ok, "allreduce on a communicator-built set")
    finally:
        run_all(mpidp.remove_process_set, ps)
        if comm != MPI.COMM_NULL:
            comm.Free()


@pytest.mark.parametrize("static", [False, True])
def test_communicator_split_several_ways_gives_one_set_per_part(static):
    """Horovod's own example: COMM_WORLD split by parity, one ProcessSet object on every rank;
    each rank's object is its part's set, and removing it removes every part."""
    rank, size = _world()
    comm = MPI.COMM_WORLD.Split(color=rank % 2, key=rank)
    mine = list(range(rank % 2, size, 2))
    ps = mpidp.ProcessSet(comm)
    if static:
        mpidp.shutdown()
        run_all(mpidp.init, process_sets=[ps])
    else:
        ps = run_all(mpidp.add_process_set, ps)
    try:
        out = run_all(mpidp.allreduce, torch.tensor([float(rank)]), op=mpidp.Sum, process_set=ps)
        ok = (
            ps.ranks == mine
            and ps.size() == len(mine)
            and ps.rank() == mine.index(rank)
            and out.item() == sum(mine)
            and len(mpidp.runtime.world.state().sets) == 3
        )
        assert_all(ok, (ps, ps.ranks, out, mpidp.runtime.world.state().sets))
    finally:
        if static:
            mpidp.shutdown()
            mpidp.init()
        else:
            run_all(mpidp.remove_process_set, ps)
            sets = mpidp.runtime.world.state().sets
            assert_all(list(sets) == [0], sets)
            again = run_all(mpidp.add_process_set, list(range(0, size, 2)))  # a part, freed
            run_all(mpidp.remove_process_set, again)
        comm.Free()


def test_communicators_that_overlap_are_refused():
    rank, size = _world()
    comm = MPI.COMM_WORLD.Split(color=0 if rank < 2 else 1, key=rank)
    # Rank 0 names a set its partner does not: [0] alone, while rank 1 says [0, 1].
    ps = mpidp.ProcessSet(MPI.COMM_SELF if rank == 0 else comm)
    raises_all(ValueError, mpidp.add_process_set, ps, match="ranks disagree")
    comm.Free()


@pytest.mark.mpi(min_size=3)  # at 2 ranks the set [0, 1] would be the global set
def test_pending_op_fails_when_its_set_is_removed():
    rank, size = _world()
    ps = run_all(mpidp.add_process_set, [0, 1])
    sid = ps.process_set_id
    handle = run_all(
        lambda: (
            mpidp.allreduce_async(torch.ones(1), name="never.matched", process_set=ps)
            if rank == 1
            else None
        )
    )
    # Only once rank 1's op is in flight may the others remove the set (which stops its engine).
    gather(None)
    run_all(mpidp.remove_process_set, ps)
    err = None
    if rank == 1:
        try:
            mpidp.synchronize(handle)
        except mpidp.EngineShutdownError as exc:
            err = str(exc)
    assert_all(
        rank != 1 or (err and f"process set {sid} was removed" in err),
        f"pending op after removal: {err}",
    )


@pytest.mark.mpi(min_size=3)  # at 2 ranks the set [0, 1] would be the global set
def test_op_on_a_set_removed_by_another_member_says_so():
    rank, size = _world()
    ps = run_all(mpidp.add_process_set, [0, 1])
    sid = ps.process_set_id
    if rank == 0:
        mpidp.remove_process_set(ps)  # rank 0 first: the set's engine stops on rank 1 too
    gather(None)
    err = None
    if rank == 1:  # rank 0 never submits it: the op can only fail, at submission or pending
        try:
            mpidp.synchronize(mpidp.allreduce_async(torch.ones(1), name="late", process_set=ps))
        except mpidp.EngineShutdownError as exc:
            err = str(exc)
    if rank != 0:
        mpidp.remove_process_set(ps)
    assert_all(rank != 1 or (err and f"process set {sid} was removed" in err), err)


def test_static_sets_given_to_init():
    rank, size = _world()
    mpidp.shutdown()
    try:
        first = mpidp.ProcessSet([0, size - 1] if size > 2 else [0])
        second = mpidp.ProcessSet([1, 2] if size > 2 else [1])
        run_all(mpidp.init, process_sets=[first, second])
        ids = (first.process_set_id, second.process_set_id)
        assert_all(ids == (1, 2), ids)

        def body():
            sums = []
            for ps in (first, second):
                if ps.included():
                    sums.append(
                        (
                            mpidp.allreduce(
                                torch.ones(1), op=mpidp.Sum, name="static", process_set=ps
                            ).item(),
                            ps.size(),
                        )
                    )
            return sums

        sums = run_all(body)
        assert_all(sums and all(a == b for a, b in sums), sums)
    finally:
        mpidp.shutdown()
        mpidp.init()


def test_join_with_distributed_optimizer_on_sets(evens_odds, device):
    """Each rank trains on its set (evens, odds) with uneven data (rank r has r + 1 steps) and
    allreduces its loss over the world each step, then calls join(). A rank out of data is
    joined in its set too: the members still training get its zeros instead of waiting for it,
    and end where a DistributedOptimizer on the set does when ranks out of data submit zeros."""
    rank, size = _world()
    mine, _ = _mine(*evens_odds)
    longest = max(mine.ranks)
    torch.manual_seed(3)
    data = [
        (torch.randn(5, 4, device=device), torch.randn(5, 2, device=device)) for _ in range(size)
    ]
    models = [torch.nn.Linear(4, 2).to(device) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [
        mpidp.DistributedOptimizer(
            torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9),
            named_parameters=m.named_parameters(),
            process_set=mine,
        )
        for m in models
    ]
    losses, local = [], []

    def train(steps, model, opt, log):
        for i in range(steps):
            opt.zero_grad()
            if i <= rank:
                x, y = data[i]
                loss = (model(x) - y).pow(2).mean()
                loss.backward()
                if log:
                    local.append(loss.item())
                    losses.append(
                        mpidp.allreduce(loss.detach(), name=f"ps.join.loss{i}", op=mpidp.Sum).item()
                    )
            opt.step()

    train(rank + 1, models[0], opts[0], log=True)
    last = run_all(mpidp.join)
    # The reference: every member steps as often as the set's longest, with zeros when out.
    run_all(train, longest + 1, models[1], opts[1], log=False)
    got = [p.detach() for p in models[0].parameters()]
    want = [p.detach() for p in models[1].parameters()]
    err = max((a - b).abs().max().item() for a, b in zip(got, want))
    ok = rank != longest or err < 1e-12
    # Step i's loss sums the ranks with more than i steps (the joined ranks add zeros).
    sums, mine_each = gather(losses), gather(local)
    want_sums = [sum(v[i] for v in mine_each if len(v) > i) for i in range(size)]
    sums_ok = all(abs(got_i - want_sums[i]) < 1e-5 for s in sums for i, got_i in enumerate(s))
    assert_all(
        ok and sums_ok,
        f"deviation {err} from the reference; loss sums {sums}, expected {want_sums}",
    )
    refs = gather([p.cpu().tolist() for p in want])
    assert_all(all(refs[r] == refs[longest] for r in mine.ranks), "reference members differ")
    assert_all(gather(last) == [size - 1] * size, f"join() returned {gather(last)}")
