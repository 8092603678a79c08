"""16-bit floats on the wire: mpidp allreduce of float16/bfloat16 against float32, one MPI job.

    mpiexec -n 2 python benchmarks/half_wire.py [--rounds 9] [--sizes 4M,16M,64M]
    tests/run_tcp_env.sh mpiexec -n 2 python benchmarks/half_wire.py    (MPICH over TCP)
    MPIDP_BACKEND=gloo mpiexec -n 2 python benchmarks/half_wire.py     (gloo data path)

For each size (bytes of the float32 tensor; the 16-bit ones hold the same number of elements),
contenders run once each per round, in an order shuffled anew each round:

  fp32           mpidp.allreduce_(t) of the float32 tensor
  fp16, bf16     the same call on a float16 / bfloat16 tensor of the same elements
  fp32_widened   what the data path did before 16-bit floats kept their width: copy a float16
                 tensor into a float32 buffer, allreduce_ that, copy back
  raw_fp32       comm.Allreduce(IN_PLACE) of the float32 tensor (mpi4py, no mpidp)

Every sample is the largest elapsed time over the ranks, after a barrier; the table gives
medians over the rounds and each contender's ratio to mpidp's fp32, and the wire bytes per
element that mpidp.stats() counted for the 16-bit runs.
"""

import argparse
import statistics
import time

import torch
from mpi4py import MPI
from rounds import order as rounds_order

import mpidp

MB = 1024 * 1024


def _size(text: str) -> int:
    scale = {"K": 1024, "M": MB}.get(text[-1].upper(), 1)
    return int(text[:-1] if scale != 1 else text) * scale


def _timed(comm, fn) -> float:
    comm.Barrier()
    began = time.perf_counter()
    fn()
    return comm.allreduce(time.perf_counter() - began, op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sizes", default="4M,16M,64M")
    args = parser.parse_args()
    mpidp.init()
    comm = MPI.COMM_WORLD.Dup()
    rank = comm.Get_rank()
    if rank == 0:
        names = mpidp.runtime.world.state().engine.backend.names
        print(f"# {comm.Get_size()} ranks, data path {names}", flush=True)
        print(
            f"{'fp32 size':>10} "
            + " ".join(f"{c:>20}" for c in ("fp32", "fp16", "bf16", "fp32_widened", "raw_fp32"))
            + "  wire B/elem fp16 bf16"
        )
    for nbytes in [_size(s) for s in args.sizes.split(",")]:
        n = nbytes // 4
        base = torch.randn(n)
        tensors = {
            "fp32": base.clone(),
            "fp16": base.half(),
            "bf16": base.bfloat16(),
            "raw_fp32": base.clone(),
        }
        widened_src, widened_buf = base.half(), torch.empty(n)

        def widened():
            widened_buf.copy_(widened_src)
            mpidp.allreduce_(widened_buf, name=f"hw.widened.{n}")
            widened_src.copy_(widened_buf)

        calls = {
            "fp32": lambda: mpidp.allreduce_(tensors["fp32"], name=f"hw.fp32.{n}"),
            "fp16": lambda: mpidp.allreduce_(tensors["fp16"], name=f"hw.fp16.{n}"),
            "bf16": lambda: mpidp.allreduce_(tensors["bf16"], name=f"hw.bf16.{n}"),
            "fp32_widened": widened,
            "raw_fp32": lambda: comm.Allreduce(MPI.IN_PLACE, tensors["raw_fp32"].numpy()),
        }
        names = list(calls)
        for name in names:  # warm-up: negotiation, buffers, page faults
            calls[name]()
        samples = {name: [] for name in names}
        wire = {}
        for r in range(args.rounds):
            for name in rounds_order(names, r):
                if name in ("fp16", "bf16"):
                    mpidp.stats(reset=True)
                samples[name].append(_timed(comm, calls[name]))
                if name in ("fp16", "bf16"):
                    wire[name] = mpidp.stats()["wire_bytes"] / n
            for t in tensors.values():  # keep values finite: allreduce_ sums in place
                t.fill_(0.5)
            widened_src.fill_(0.5)
        med = {name: statistics.median(v) for name, v in samples.items()}
        if rank == 0:
            cells = " ".join(f"{med[c] * 1e3:9.2f} ms ({med[c] / med['fp32']:.2f}x)" for c in names)
            print(
                f"{nbytes // MB:>7} MB {cells}  {wire['fp16']:.1f} {wire['bf16']:.1f}", flush=True
            )
    mpidp.shutdown()


if __name__ == "__main__":
    main()
