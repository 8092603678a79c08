"""Collectives called under torch.inference_mode() (validation metrics, as Lightning runs them)."""

import time

import pytest
import torch
from mpi_util import assert_all

import mpidp


@pytest.mark.mpi
@pytest.mark.parametrize("driven", [False, True], ids=["engine_thread", "this_thread"])
def test_collectives_work_in_inference_mode_and_after_it(driven):
    """Ops run by the engine thread (async, with time to start there) or on this thread
    (blocking): the engine scales and writes inference tensors in place, which torch refuses
    outside inference mode (that aborted the job), and fusion buffers made meanwhile must serve
    ops outside inference mode later."""
    r, n = mpidp.rank(), mpidp.size()
    got = []
    for rnd in range(2):
        with torch.inference_mode():
            if driven:
                fused = mpidp.grouped_allreduce(
                    [torch.full((3,), float(r + i)) for i in range(4)],
                    op=mpidp.Sum,
                    name=f"inf.g{rnd}",
                )
                avg = [mpidp.allreduce(torch.full((2,), float(r)), name=f"inf.a{rnd}")]
            else:
                hs = [
                    mpidp.grouped_allreduce_async(
                        [torch.full((3,), float(r + i)) for i in range(4)],
                        op=mpidp.Sum,
                        name=f"inf.g{rnd}",
                    )
                ]
                hs += [mpidp.allreduce_async(torch.full((2,), float(r)), name=f"inf.a{rnd}")]
                time.sleep(0.05)
                fused, avg = mpidp.synchronize(hs[0]), [mpidp.synchronize(hs[1])]
            inplace = torch.ones(5)
            mpidp.allreduce_(inplace, op=mpidp.Sum, name=f"inf.ip{rnd}")
            root = mpidp.broadcast(torch.full((2,), float(r)), root_rank=0, name=f"inf.b{rnd}")
            gathered = mpidp.allgather(torch.full((1, 2), float(r)), name=f"inf.ag{rnd}")
        after = mpidp.grouped_allreduce(
            [torch.full((3,), float(r + i)) for i in range(4)], op=mpidp.Sum, name=f"normal.g{rnd}"
        )
        got.append(
            [t[0].item() for t in fused]
            + [
                avg[0][0].item(),
                inplace[0].item(),
                root[0].item(),
                gathered[:, 0].tolist(),
                [t[0].item() for t in after],
            ]
        )
    total = n * (n - 1) / 2
    want = [total + n * i for i in range(4)] + [
        total / n,
        float(n),
        0.0,
        [float(k) for k in range(n)],
        [total + n * i for i in range(4)],
    ]
    assert_all(got == [want, want], f"got {got}, want {want}")
