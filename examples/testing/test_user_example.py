"""A user's test file for code built on mpidp: run it under mpiexec with pytest-mpi.

    mpiexec -n 2 python -m pytest --with-mpi -p no:cacheprovider \
        --timeout=120 --timeout-method=thread examples/testing

Every test is marked `mpi` (a plain `pytest` run skips them) and checks its results with the
collective `check` fixture (conftest.py), so a failure on any rank fails the test on all ranks.
Set EXAMPLE_FAIL_ON_RANK=<k> to activate test_deliberate_failure, which fails on rank k only.
"""

import os

import pytest
import torch

import mpidp


@pytest.mark.mpi
def test_allreduce_average(check):
    r, n = mpidp.rank(), mpidp.size()
    out = mpidp.allreduce(torch.full((3,), float(r)), name="example.average")
    check(out.tolist() == [(n - 1) / 2] * 3, f"got {out.tolist()}")


@pytest.mark.mpi
def test_allgather_with_uneven_rows(check):
    r, n = mpidp.rank(), mpidp.size()
    out = mpidp.allgather(torch.full((r + 1, 2), r), name="example.gather")
    want = [k for k in range(n) for _ in range(k + 1)]
    check(out[:, 0].tolist() == want, f"got {out[:, 0].tolist()}")


@pytest.mark.mpi
def test_training_keeps_replicas_identical(check):
    """Different data on each rank, same parameters everywhere after every step."""
    r = mpidp.rank()
    torch.manual_seed(100 + r)  # different initial weights on purpose
    model = torch.nn.Linear(4, 2)
    mpidp.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = mpidp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
    )
    for step in range(3):
        x = torch.randn(8, 4) + r
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    weights = mpidp.allgather_object(model.weight.detach().clone())
    check(all(torch.equal(w, weights[0]) for w in weights), "replicas diverged")


@pytest.mark.mpi
def test_each_rank_has_its_own_tmp_path(tmp_path, check):
    (tmp_path / "mine.txt").write_text(str(mpidp.rank()))
    paths = mpidp.allgather_object(str(tmp_path))
    check(len(set(paths)) == mpidp.size(), f"ranks share a temporary directory: {paths}")
    check((tmp_path / "mine.txt").read_text() == str(mpidp.rank()), "another rank wrote here")


@pytest.mark.mpi
def test_shared_directory_from_rank_0(mpi_tmp_path, check):
    """pytest-mpi's mpi_tmp_path is rank 0's tmp_path on every rank: one directory for files
    that every rank reads (on one host, or on a shared file system)."""
    if mpidp.rank() == 0:
        torch.save({"step": 7}, mpi_tmp_path / "checkpoint.pt")
    mpidp.barrier()  # the file exists before anyone reads it
    state = torch.load(mpi_tmp_path / "checkpoint.pt")
    check(state == {"step": 7}, f"read {state}")


@pytest.mark.mpi(min_size=2)
def test_needs_two_ranks(check):
    """Skipped at -n 1 by pytest-mpi on every rank alike."""
    out = mpidp.broadcast(torch.tensor([mpidp.rank()]), root_rank=1, name="example.bcast")
    check(out.tolist() == [1], f"got {out.tolist()}")


@pytest.mark.mpi
@pytest.mark.skipif(
    "EXAMPLE_FAIL_ON_RANK" not in os.environ,
    reason="set EXAMPLE_FAIL_ON_RANK=<k> to see one rank's failure fail all",
)
def test_deliberate_failure(check):
    bad_rank = int(os.environ["EXAMPLE_FAIL_ON_RANK"])
    value = mpidp.allreduce(torch.ones(1), op=mpidp.Sum, name="example.fail").item()
    if mpidp.rank() == bad_rank:
        value += 1  # this rank computes a wrong answer
    check(value == mpidp.size(), f"expected {mpidp.size()}, computed {value}")
    # Every rank raised in check() above, so none reaches this collective and none waits.
    mpidp.allreduce(torch.ones(1), name="example.after_failure")


@pytest.mark.mpi
def test_after_the_failure_everything_still_works(check):
    """Runs after test_deliberate_failure: the ranks are still in step."""
    out = mpidp.allreduce(torch.ones(2), op=mpidp.Sum, name="example.still_working")
    check(out.tolist() == [float(mpidp.size())] * 2, f"got {out.tolist()}")
