"""mpidp.elastic under MPI: commit/restore/sync, persisted commits with run, ElasticSampler."""

import dataclasses
import os

import pytest
import torch
from mpi_util import assert_all, gather, raises_all, run_all

import mpidp
from mpidp import checkpoint, elastic
from mpidp.runtime import world

pytestmark = pytest.mark.timeout(120)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 1))


def _step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(6, 4, generator=gen)).square().mean().backward()
    opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- ObjectState ----


def test_object_state_commit_and_restore():
    state = elastic.ObjectState(epoch=0, history=[1])
    state.epoch, state.history = 5, state.history + [2]
    state.restore()  # construction counts as a commit
    assert_all((state.epoch, state.history) == (0, [1]), f"{state.epoch} {state.history}")
    state.epoch = 2
    state.history.append(3)
    state.commit()
    state.history.append(4)  # mutating in place must not reach the commit
    state.epoch = 9
    state.restore()
    assert_all((state.epoch, state.history) == (2, [1, 3]), f"{state.epoch} {state.history}")


def test_object_state_sync_makes_rank0s_values_everywhere():
    state = elastic.ObjectState(epoch=mpidp.rank(), tag=f"rank{mpidp.rank()}")
    state.sync()
    assert_all((state.epoch, state.tag) == (0, "rank0"), f"{state.epoch} {state.tag}")
    state.epoch = 7
    state.restore()  # sync commits what it synced
    assert_all(state.epoch == 0, f"restore after sync gave {state.epoch}")


@pytest.mark.parametrize(
    "cls, kwargs",
    [
        (elastic.ObjectState, {"commit": 1}),
        (elastic.ObjectState, {"_hidden": 1}),
        (elastic.TorchState, {"sync": 2}),
    ],
)
def test_names_that_hide_methods_are_refused(cls, kwargs):
    raises_all(ValueError, cls, **kwargs)


# ---- TorchState ----


def test_torch_state_commit_restore_model_optimizer_and_values():
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    state = elastic.TorchState(model, opt, epoch=0)
    _step(model, opt, 1)
    state.epoch = 1
    state.commit()
    committed = _params(model)
    committed_avg = [opt.state[p]["exp_avg"].clone() for p in model.parameters()]
    for seed in (2, 3):
        _step(model, opt, seed)
    state.epoch = 3
    state.restore()
    ok = (
        _equal(_params(model), committed)
        and state.epoch == 1
        and _equal([opt.state[p]["exp_avg"] for p in model.parameters()], committed_avg)
        and int(opt.state[next(model.parameters())]["step"]) == 1
    )
    assert_all(ok, "restore did not return model, Adam state and values to the commit")
    _step(model, opt, 4)  # steps after a restore must not change the commit itself
    state.restore()
    assert_all(_equal(_params(model), committed), "the commit was changed by a later step")


def test_torch_state_sync_makes_everything_rank0s():
    rank = mpidp.rank()
    model = _model(rank)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (rank + 1), momentum=0.9)
    _step(model, opt, rank)
    sampler = elastic.ElasticSampler(range(40), seed=rank)
    sampler.set_epoch(rank + 1)
    state = elastic.TorchState(model, opt, sampler=sampler, batch=rank)
    state.sync()
    rank0 = gather(
        (
            _params(model),
            opt.param_groups[0]["lr"],
            [opt.state[p]["momentum_buffer"] for p in model.parameters()],
            sampler.state_dict(),
            state.batch,
        )
    )[0]
    mine = (
        _params(model),
        opt.param_groups[0]["lr"],
        [opt.state[p]["momentum_buffer"] for p in model.parameters()],
        sampler.state_dict(),
        state.batch,
    )
    ok = (
        _equal(mine[0], rank0[0])
        and mine[1] == rank0[1]
        and _equal(mine[2], rank0[2])
        and mine[3:] == rank0[3:] == ({"epoch": 1, "processed": 0, "seed": 0}, 0)
    )
    assert_all(ok, f"after sync: {mine[1:]} vs rank 0's {rank0[1:]}")


# ---- persisted commits and run ----


def test_run_without_a_commit_syncs_and_calls_func(shared_dir):
    path = os.path.join(shared_dir, "none.pt")
    rank = mpidp.rank()
    model = _model(rank)
    calls = []
    state = elastic.TorchState(
        model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint_path=path, epoch=rank
    )
    state.register_reset_callbacks([lambda: calls.append("reset")])

    @elastic.run
    def train(st, factor):
        return st.epoch * factor

    result = run_all(train, state, 10)
    rank0 = gather(_params(model))[0]
    assert_all(
        result == 0 and calls == [] and _equal(_params(model), rank0),
        f"result {result}, callbacks {calls}",
    )


def test_run_resumes_from_the_persisted_commit(shared_dir):
    path = os.path.join(shared_dir, "commit.pt")
    model = _model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    sampler = elastic.ElasticSampler(range(64), seed=1)
    state = elastic.TorchState(model, opt, checkpoint_path=path, sampler=sampler, epoch=0)
    _step(model, opt, 1)
    sampler.set_epoch(2)
    sampler.record_batch(0, 4)
    state.epoch = 2
    torch.manual_seed(100 + mpidp.rank())
    run_all(state.commit)
    expected_draw = torch.rand(2)
    committed = _params(model)
    _step(model, opt, 2)  # work after the commit is lost by the "restart" below

    # A restarted job: everything built afresh, then run() finds the commit.
    torch.manual_seed(7)
    fresh = _model(5)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.05)
    fresh_sampler = elastic.ElasticSampler(range(64), seed=1)
    again = elastic.TorchState(
        fresh, fresh_opt, checkpoint_path=path, sampler=fresh_sampler, epoch=0
    )
    calls = []
    again.register_reset_callbacks([lambda: calls.append(again.epoch)])
    seen = {}

    @elastic.run
    def train(st):
        seen["draw"] = torch.rand(2)
        seen["epoch"] = st.epoch
        seen["sampler"] = st.sampler.state_dict()
        return "done"

    assert_all(run_all(train, again) == "done")
    ok = (
        _equal(_params(fresh), committed)
        and seen["epoch"] == 2
        and calls == [2]
        and seen["sampler"] == {"epoch": 2, "processed": 4 * mpidp.size(), "seed": 1}
        and torch.equal(seen["draw"], expected_draw)
        and int(fresh_opt.state[next(fresh.parameters())]["step"]) == 1
    )
    assert_all(ok, f"resumed state: {seen}, callbacks {calls}")


def test_knob_path_is_used_and_rank0s_path_counts(shared_dir, monkeypatch):
    rank = mpidp.rank()
    path = os.path.join(shared_dir, f"knob{rank}.pt")
    st = world.state()
    monkeypatch.setattr(st, "config", dataclasses.replace(st.config, elastic_checkpoint=path))
    state = elastic.ObjectState(epoch=3)
    run_all(state.commit)
    files = (
        sorted(e for e in os.listdir(shared_dir) if e.startswith("knob"))
        if rank == 0
        else ["knob0.pt"]
    )
    assert_all(files == ["knob0.pt"], f"files written: {files}")
    values = run_all(checkpoint.load, os.path.join(shared_dir, "knob0.pt"))
    assert_all(values == {"epoch": 3}, str(values))


def test_no_path_means_in_memory_commits_only(shared_dir):
    state = elastic.ObjectState(epoch=1)
    state.commit()
    assert_all(state.checkpoint_path() == "" and not state.resume(), "persisted without a path")


def test_corrupt_commit_is_an_error_not_a_fresh_start(shared_dir):
    path = os.path.join(shared_dir, "corrupt.pt")
    if mpidp.rank() == 0:
        with open(path, "wb") as f:
            f.write(b"not a checkpoint")
    mpidp.barrier()
    state = elastic.ObjectState(checkpoint_path=path, epoch=0)
    raises_all(checkpoint.CheckpointError, elastic.run(lambda st: None), state)


# ---- ElasticSampler ----


def _shards(n, dataset_len=23, **kwargs):
    return [
        elastic.ElasticSampler(range(dataset_len), num_replicas=n, rank=r, **kwargs)
        for r in range(n)
    ]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("drop_last", [False, True])
def test_sampler_shards_cover_the_data_set_once(n, drop_last):
    samplers = _shards(n, drop_last=drop_last, seed=4)
    lists = [list(s) for s in samplers]
    flat = sorted(i for part in lists for i in part)
    lengths = {len(part) for part in lists}
    if drop_last:
        ok = len(set(flat)) == len(flat) == 23 // n * n
    else:
        ok = set(flat) == set(range(23)) and len(flat) == -(-23 // n) * n
    assert_all(ok and len(lengths) == 1, f"n={n}: {lists}")


def test_sampler_order_depends_on_epoch_and_seed_only():
    a, b, c = (elastic.ElasticSampler(range(30), seed=s, num_replicas=1, rank=0) for s in (1, 1, 2))
    first = list(a)
    a.set_epoch(1)
    ok = (
        list(b) == first
        and list(c) != first
        and list(a) != first
        and sorted(first) == list(range(30))
    )
    unshuffled = elastic.ElasticSampler(range(7), shuffle=False, num_replicas=2, rank=1)
    assert_all(ok and list(unshuffled) == [1, 3, 5, 0], f"{first} {list(unshuffled)}")


@pytest.mark.parametrize("before, after", [(2, 2), (3, 2), (2, 4), (4, 1)])
def test_sampler_resumes_mid_epoch_without_repeating(before, after):
    batch, done_batches = 2, 2
    samplers = _shards(before, dataset_len=37, seed=9)
    for s in samplers:
        s.set_epoch(3)
    shards = [list(s) for s in samplers]
    for s in samplers:
        s.record_batch(done_batches - 1, batch)
    done = sorted(i for part in shards for i in part[: batch * done_batches])
    states = {tuple(sorted(s.state_dict().items())) for s in samplers}
    resumed = _shards(after, dataset_len=37, seed=0)
    for s in resumed:
        s.load_state_dict(samplers[0].state_dict())
    rest = [list(s) for s in resumed]
    rest_flat = [i for part in rest for i in part]
    left = 37 - len(done)
    padding = -(-left // after) * after - left
    # Every sample not done comes exactly once; the only repeats are the padding of the last round.
    fresh = [i for i in rest_flat if i not in done]
    ok = (
        len(states) == 1
        and len(done) == len(set(done)) == before * batch * done_batches
        and sorted(fresh) == sorted(set(range(37)) - set(done))
        and len(rest_flat) == left + padding
    )
    if before == after:  # the same ranks continue exactly where they were, padding included
        ok = ok and all(rest[r] == shards[r][batch * done_batches :] for r in range(after))
    assert_all(ok, f"done {done}, rest {rest}")


def test_sampler_set_epoch_keeps_a_resumed_position():
    s = elastic.ElasticSampler(range(20), num_replicas=2, rank=0)
    s.set_epoch(1)
    s.record_batch(1, 3)
    s.load_state_dict(s.state_dict())
    before = list(s)
    s.set_epoch(1)  # a loop that calls set_epoch at the top of every epoch
    kept = list(s) == before and s.processed == 12 and len(before) == 4
    s.set_epoch(2)
    assert_all(kept and s.processed == 0 and len(s) == 10, f"{before} {list(s)}")


def test_sampler_record_batch_clamps_the_last_partial_batch():
    s = elastic.ElasticSampler(range(10), num_replicas=3, rank=0)
    s.record_batch(5, 4)
    assert_all(s.processed == 10, f"processed {s.processed}")


def test_sampler_uses_mpidp_world_by_default():
    s = elastic.ElasticSampler(range(30), seed=2)
    parts = gather(list(s))
    flat = [i for part in parts for i in part]
    assert_all(set(flat) == set(range(30)) and s.num_replicas == mpidp.size(), f"{parts}")


def test_sampler_get_and_record_indices_as_in_horovod():
    """Horovod's other way of recording progress: get_indices(batch) then record_indices; it
    counts as record_batch does, and processed_indices is what every rank together has done."""
    by_batch, by_indices = _shards(3, dataset_len=23, seed=5), _shards(3, dataset_len=23, seed=5)
    done = set()
    for b in range(2):
        for s in by_indices:
            indices = s.get_indices(b, 4)
            done.update(indices)
            s.record_indices(indices)
        for s in by_batch:
            s.record_batch(b, 4)
    same = all(a.state_dict() == b.state_dict() for a, b in zip(by_batch, by_indices))
    ok = (
        same
        and by_indices[0].processed == 24 - 1
        and by_indices[0].processed_indices == set(range(23))
        and len(done) == 23
    )
    first = _shards(2, dataset_len=23, seed=5)
    for s in first:
        s.record_indices(s.get_indices(0, 3))
    seen = {i for s in first for i in s.get_indices(0, 3)}
    ok = ok and first[0].processed_indices == seen == first[1].processed_indices
    assert_all(ok, f"{[s.state_dict() for s in by_indices]} {sorted(done)}")


def test_check_host_updates_is_there_and_does_nothing():
    """Horovod's elastic scripts call it between commits; an MPI job's hosts never change."""
    state = elastic.ObjectState(epoch=1)
    state.check_host_updates()
    state.commit()
    state.check_host_updates()
    assert_all(state.epoch == 1, "state changed")
