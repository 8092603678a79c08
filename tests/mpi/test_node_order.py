"""Allreduce runs on the ranks numbered node by node, whatever order the launcher dealt them in."""

import pytest
import torch
from backend_util import ALLREDUCE, Counting, fused, host_config, single, values
from mpi4py import MPI
from mpi_util import assert_all, run_all

from mpidp.engine.backends.host import HostBackend
from mpidp.engine.mpi import Comms

RANK, SIZE = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
NODE = 2  # simulated ranks per node: world ranks 2k and 2k + 1 share node k


def _dealt():
    """COMM_WORLD renumbered as a launcher numbers ranks it deals round-robin to the nodes
    (`-hosts a:1,b:1 -n 4`): one rank of each node in turn."""
    nodes = -(-SIZE // NODE)
    return MPI.COMM_WORLD.Split(color=0, key=(RANK % NODE) * nodes + RANK // NODE)


@pytest.mark.mpi
def test_a_job_numbered_node_by_node_reduces_on_its_own_communicator():
    comms = Comms(MPI.COMM_WORLD, simulated_local_size=min(NODE, SIZE))
    try:
        assert_all(comms.node_ordered is comms.world, "a second communicator for the same order")
    finally:
        comms.free()


@pytest.mark.mpi
@pytest.mark.skipif(SIZE < 3, reason="two ranks on two nodes are in node order either way")
@pytest.mark.parametrize("chunk_bytes", [0, 256])
def test_ranks_dealt_round_robin_reduce_renumbered_node_by_node(chunk_bytes):
    base = _dealt()
    comms = Comms(base, simulated_local_size=NODE)
    ordered = comms.node_ordered
    try:
        node = RANK // NODE
        dealt_nodes = comms.world.allgather(node)
        assert_all(dealt_nodes != sorted(dealt_nodes), f"not dealt round-robin: {dealt_nodes}")
        got_nodes = ordered.allgather(node)
        assert_all(
            ordered is not comms.world and got_nodes == sorted(got_nodes),
            f"allreduce's ranks by node: {got_nodes}",
        )
        backend = HostBackend(comms, host_config(chunk_bytes=chunk_bytes))
        backend.comm = world = Counting(backend.comm)
        backend.reduce_comm = counting = Counting(backend.reduce_comm)
        bad = []
        shapes = [(5,), (300,), (3, 40)]
        for shape in shapes:
            batch, entries = single(f"no{shape}", ALLREDUCE, values(shape, torch.float32, RANK))
            got = run_all(backend.execute, batch, entries)[0][0]
            want = sum(values(shape, torch.float32, r) for r in range(SIZE))
            if not torch.equal(got, want):
                bad.append(shape)
        tensors = [values(s, torch.float64, RANK, salt=1) for s in shapes]
        batch, entries = fused("nf", tensors)
        got = run_all(backend.execute, batch, entries)
        for s, result in zip(shapes, got):
            if not torch.equal(result[0], sum(values(s, torch.float64, r, 1) for r in range(SIZE))):
                bad.append(("fused", s))
        assert_all(not bad, f"wrong sums: {bad}")
        assert_all(
            counting.calls > 0 and world.calls == 0,
            f"allreduce calls: {counting.calls} node by node, {world.calls} in the dealt order",
        )
    finally:
        comms.free()
        base.Free()
