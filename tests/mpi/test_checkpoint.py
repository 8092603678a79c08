"""mpidp.checkpoint under MPI: round trips, per-rank RNG, and failures that reach every rank."""

import os
import random
import resource
import signal

import numpy as np
import pytest
import torch
from mpi_util import assert_all, gather, raises_all, run_all

import mpidp
from mpidp import checkpoint
from mpidp.elastic import ElasticSampler

pytestmark = pytest.mark.timeout(120)


def _model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2)
    )


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 5, generator=gen).to(device)).square().mean().backward()
        opt.step()


def _draws():
    return (
        torch.rand(3).tolist(),
        np.random.rand(3).tolist(),
        random.random(),
        np.random.randn(),
    )  # randn last: numpy's cached gaussian is part of the state


def _seed_all(seed):
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    np.random.randn()  # leaves a cached gaussian (has_gauss=1) in numpy's state


def _same_state(a, b):
    return set(a) == set(b) and all(
        a[k].device == b[k].device and torch.equal(a[k], b[k]) for k in a
    )


def _cpu_state(model):
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def test_round_trip_model_optimizer_values_sampler_and_rng(shared_dir):
    path = os.path.join(shared_dir, "ckpt.pt")
    rank = mpidp.rank()
    model = _model(seed=rank)  # different on every rank: rank 0's must win
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, 3, seed=rank)
    sampler = ElasticSampler(list(range(50)), seed=3)
    sampler.set_epoch(2)
    sampler.record_batch(1, 4)
    _seed_all(1000 + rank)
    run_all(
        checkpoint.save,
        path,
        model=model,
        optimizer=opt,
        sampler=sampler,
        epoch=7,
        extra={"lr": [0.1, 0.2], "name": "run"},
    )
    expected = _draws()
    saved_model = gather({k: v.clone() for k, v in model.state_dict().items()})[0]

    _seed_all(5)  # the RNG moves on; load must bring each rank's own state back
    fresh = _model(seed=99)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.5)
    fresh_sampler = ElasticSampler(list(range(50)), seed=3)
    rest = run_all(checkpoint.load, path, model=fresh, optimizer=fresh_opt, sampler=fresh_sampler)
    got = _draws()
    assert_all(got == expected, f"RNG draws after load {got} != after save {expected}")
    every = gather(got)
    assert_all(mpidp.size() == 1 or every[0] != every[1], "ranks got the same RNG state back")
    assert_all(
        rest == {"epoch": 7, "extra": {"lr": [0.1, 0.2], "name": "run"}}, f"values returned: {rest}"
    )
    assert_all(_same_state(fresh.state_dict(), saved_model), "model is not rank 0's")
    assert_all(
        fresh_sampler.state_dict() == {"epoch": 2, "processed": 8 * mpidp.size(), "seed": 3},
        f"sampler state {fresh_sampler.state_dict()}",
    )
    # Rank 0's optimizer and the loaded ones take the same next step.
    opt_state = gather(opt.state_dict())[0]
    loaded = fresh_opt.state_dict()
    assert_all(loaded["param_groups"][0]["lr"] == 0.01, "lr not restored")
    ok = all(
        torch.equal(loaded["state"][i][k], opt_state["state"][i][k])
        for i in opt_state["state"]
        for k in ("exp_avg", "exp_avg_sq", "step")
    )
    assert_all(ok, "Adam state differs from rank 0's")


def test_distributed_optimizer_round_trip(shared_dir, device):
    """A model and optimizer on `device` saved and loaded into fresh ones on that device."""
    path = os.path.join(shared_dir, f"dist.{device.type}.pt")
    model = _model(seed=0).to(device)
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
    )
    _train(model, opt, 2, seed=mpidp.rank())
    run_all(checkpoint.save, path, model=model, optimizer=opt)
    fresh = _model(seed=1).to(device)
    fresh_opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9),
        named_parameters=fresh.named_parameters(),
    )
    run_all(checkpoint.load, path, model=fresh, optimizer=fresh_opt)
    # Gradients are averaged, so parameters and momentum agree; BatchNorm's running statistics
    # do not (each rank saw its own data), and the loaded ones must be rank 0's.
    bufs = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    want = [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    assert_all(
        all(a.device == device and torch.equal(a, b) for a, b in zip(bufs, want)),
        "momentum differs, or is not on the model's device",
    )
    rank0 = gather(_cpu_state(model))[0]
    on_device = all(v.device == device for v in fresh.state_dict().values())
    assert_all(
        on_device and _same_state(_cpu_state(fresh), rank0),
        "model is not rank 0's, or is not on its device",
    )


def test_missing_file_fails_every_rank(shared_dir):
    path = os.path.join(shared_dir, "nothing.pt")
    exc = raises_all(checkpoint.CheckpointNotFoundError, checkpoint.load, path, match=path)
    assert_all(isinstance(exc, FileNotFoundError), "not a FileNotFoundError")


@pytest.mark.parametrize("where", ["parent is a file", "no such directory"])
def test_unwritable_location_fails_every_rank(shared_dir, where):
    blocker = os.path.join(shared_dir, "plain_file")
    if mpidp.rank() == 0:
        with open(blocker, "w") as f:
            f.write("x")
    mpidp.barrier()
    path = os.path.join(
        blocker if where == "parent is a file" else os.path.join(shared_dir, "missing_dir"),
        "ckpt.pt",
    )
    exc = raises_all(checkpoint.CheckpointError, checkpoint.save, path, epoch=1)
    assert_all("failed on rank 0" in str(exc), str(exc))


def test_disk_full_keeps_previous_checkpoint_and_fails_every_rank(shared_dir):
    path = os.path.join(shared_dir, "full.pt")
    run_all(checkpoint.save, path, weights=torch.zeros(10), version=1)
    big = torch.ones(1 << 20)  # 4 MiB: more than the file size limit below allows
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    if mpidp.rank() == 0:
        # A file-size limit makes write() fail with EFBIG, as a full disk fails it with ENOSPC.
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, old_limit[1]))
    try:
        exc = raises_all(checkpoint.CheckpointError, checkpoint.save, path, weights=big, version=2)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert_all("File too large" in str(exc), str(exc))
    rest = run_all(checkpoint.load, path)
    assert_all(
        rest["version"] == 1 and torch.equal(rest["weights"], torch.zeros(10)),
        f"previous checkpoint changed: {rest}",
    )
    leftovers = [e for e in os.listdir(shared_dir) if ".tmp-" in e] if mpidp.rank() == 0 else []
    assert_all(not leftovers, f"temporary files left: {leftovers}")


def test_value_a_weights_only_load_refuses_fails_every_rank_and_writes_nothing(shared_dir):
    path = os.path.join(shared_dir, "refused.pt")
    exc = raises_all(
        checkpoint.CheckpointError,
        checkpoint.save,
        path,
        stats={"hist": np.zeros(3)},
        match="stats",
    )
    assert_all("numpy" in str(exc) and "weights_only" in str(exc), str(exc))
    assert_all(not os.path.exists(path) or mpidp.rank() != 0, "a file was written")


def test_distributed_sampler_is_stored_as_its_epoch(shared_dir):
    """torch's DistributedSampler has no state_dict(): its shuffle is a function of seed and
    epoch, so the epoch is what a checkpoint keeps and set_epoch() what load gives back."""
    path = os.path.join(shared_dir, "sampler.pt")
    data = list(range(40))

    def sampler():
        return torch.utils.data.distributed.DistributedSampler(
            data, num_replicas=mpidp.size(), rank=mpidp.rank(), seed=5
        )

    saved = sampler()
    saved.set_epoch(3)
    run_all(checkpoint.save, path, sampler=saved, epoch=3)
    fresh = sampler()
    rest = run_all(checkpoint.load, path, sampler=fresh)
    same = fresh.epoch == 3 and list(fresh) == list(saved) and rest == {"epoch": 3}
    assert_all(same, f"epoch {fresh.epoch}, rest {rest}")


class _Opaque:
    def __init__(self):
        self.x = 1


def test_an_object_without_state_is_refused_with_what_to_do(shared_dir):
    path = os.path.join(shared_dir, "opaque.pt")
    exc = raises_all(
        checkpoint.CheckpointError, checkpoint.save, path, thing=_Opaque(), match="thing"
    )
    assert_all("state_dict()" in str(exc) and "set_epoch()" in str(exc), str(exc))


def test_reserved_name_is_refused():
    raises_all(ValueError, checkpoint.save, "/nonexistent/x.pt", restore_rng=True)


def test_target_not_in_checkpoint_and_plain_value_target(shared_dir):
    path = os.path.join(shared_dir, "targets.pt")
    run_all(checkpoint.save, path, epoch=3)
    raises_all(
        checkpoint.CheckpointError,
        checkpoint.load,
        path,
        model=_model(0),
        match="holds no ['model']",
    )
    raises_all(
        checkpoint.CheckpointError,
        checkpoint.load,
        path,
        epoch=ElasticSampler(range(4)),
        match="plain value",
    )


@pytest.mark.parametrize("content", ["foreign", "truncated"])
def test_foreign_or_torn_file_fails_every_rank(shared_dir, content):
    path = os.path.join(shared_dir, f"{content}.pt")
    if content == "truncated":
        run_all(checkpoint.save, path, blob=torch.ones(1000))
    if mpidp.rank() == 0:
        if content == "foreign":
            torch.save({"weights": torch.ones(2)}, path)
        else:
            with open(path, "r+b") as f:
                f.truncate(os.path.getsize(path) // 2)
    mpidp.barrier()
    raises_all(checkpoint.CheckpointError, checkpoint.load, path)


def test_damaged_tensor_bytes_fail_every_rank_naming_the_file(shared_dir):
    """A byte flipped inside a tensor's data: torch.load would load the wrong number silently."""
    path = os.path.join(shared_dir, "damaged.pt")
    run_all(checkpoint.save, path, blob=torch.arange(100_000, dtype=torch.float32))
    if mpidp.rank() == 0:
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)  # well inside the 400 kB of the tensor
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    mpidp.barrier()
    exc = raises_all(checkpoint.CheckpointError, checkpoint.load, path, match="is damaged")
    assert_all("damaged.pt" in str(exc) and "CRC-32" in str(exc), str(exc))


def test_other_world_size_loads_state_but_leaves_rng(shared_dir):
    path = os.path.join(shared_dir, "resized.pt")
    run_all(checkpoint.save, path, epoch=4)
    if mpidp.rank() == 0:
        payload = torch.load(path, weights_only=True)
        payload["rng"].append(payload["rng"][0])
        payload["world_size"] += 1
        torch.save(payload, path)
    mpidp.barrier()
    _seed_all(11)
    rest = run_all(checkpoint.load, path)
    assert_all(rest == {"epoch": 4}, str(rest))
    got = _draws()
    _seed_all(11)
    assert_all(got == _draws(), "RNG state was changed by a checkpoint of another world size")


def test_restore_rng_false_leaves_rng(shared_dir):
    path = os.path.join(shared_dir, "norng.pt")
    run_all(checkpoint.save, path, epoch=1)
    _seed_all(12)
    run_all(checkpoint.load, path, restore_rng=False)
    got = _draws()
    _seed_all(12)
    assert_all(got == _draws(), "restore_rng=False changed the RNG")


def test_stale_temporaries_are_removed_by_the_next_save(shared_dir):
    path = os.path.join(shared_dir, "stale.pt")
    stale = os.path.join(shared_dir, ".stale.pt.tmp-12345")
    other = os.path.join(shared_dir, ".other.pt.tmp-12345")
    if mpidp.rank() == 0:
        for name in (stale, other):
            with open(name, "wb") as f:
                f.write(b"torn")
    mpidp.barrier()
    run_all(checkpoint.save, path, epoch=1)
    ok = mpidp.rank() != 0 or (not os.path.exists(stale) and os.path.exists(other))
    assert_all(ok, f"stale temporary handling: {os.listdir(shared_dir)}")
