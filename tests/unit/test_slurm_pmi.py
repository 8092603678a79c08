"""runtime/slurm_pmi.py: when mpidp picks MPICH's OFI netmod before MPI starts, and when not."""

import os
import socket

import pytest

from mpidp.runtime import slurm_pmi

NOTE = "MPICH_CH4_NETMOD=ofi was set"


@pytest.fixture
def srun_pmi(monkeypatch):
    """An environment as `srun --mpi=pmi2 -N 2` gives a task, with slurmstepd behind PMI_FD and
    the `mpich` wheel (both netmods) installed."""
    monkeypatch.setattr(slurm_pmi, "_pmi_server", lambda fd: "slurmstepd")
    monkeypatch.setattr(slurm_pmi, "_wheel_has_ofi", lambda: True)
    return {"PMI_FD": "11", "PMI_RANK": "0", "SLURM_STEP_NUM_NODES": "2", "SLURM_MPI_TYPE": "pmi2"}


def test_srun_across_nodes_picks_ofi(srun_pmi):
    note = slurm_pmi.choose_netmod(srun_pmi)
    assert srun_pmi["MPICH_CH4_NETMOD"] == "ofi"
    assert NOTE in note and "2 nodes" in note and "MPICH_CH4_NETMOD=ucx" in note


@pytest.mark.parametrize("var", slurm_pmi.NETMOD_VARIABLES)
def test_a_netmod_the_user_chose_is_kept(srun_pmi, var):
    srun_pmi[var] = "ucx"
    assert slurm_pmi.choose_netmod(srun_pmi) is None
    assert srun_pmi[var] == "ucx"
    assert "MPICH_CH4_NETMOD" not in srun_pmi or var == "MPICH_CH4_NETMOD"


@pytest.mark.parametrize(
    "change",
    [
        {"SLURM_STEP_NUM_NODES": "1"},  # one node: no address crosses PMI
        {"SLURM_STEP_NUM_NODES": None},  # not a Slurm step
        {"PMI_FD": None},  # no PMI-1 socket (hydra's PMI_PORT, a singleton, PMIx)
    ],
)
def test_left_alone_without_srun_pmi_across_nodes(srun_pmi, change):
    for var, value in change.items():
        if value is None:
            del srun_pmi[var]
        else:
            srun_pmi[var] = value
    assert slurm_pmi.choose_netmod(srun_pmi) is None
    assert "MPICH_CH4_NETMOD" not in srun_pmi


def test_left_alone_under_hydra_or_without_the_wheel(srun_pmi, monkeypatch):
    monkeypatch.setattr(slurm_pmi, "_pmi_server", lambda fd: "hydra_pmi_proxy")
    assert slurm_pmi.choose_netmod(dict(srun_pmi)) is None
    monkeypatch.setattr(slurm_pmi, "_pmi_server", lambda fd: "slurmstepd")
    monkeypatch.setattr(slurm_pmi, "_wheel_has_ofi", lambda: False)
    assert slurm_pmi.choose_netmod(dict(srun_pmi)) is None


def test_pmi_server_names_the_process_that_made_the_socket_pair():
    a, b = socket.socketpair()
    try:
        with open("/proc/self/comm") as f:
            me = f.read().strip()
        assert slurm_pmi._pmi_server(a.fileno()) == me
        assert slurm_pmi._pmi_server(b.fileno()) == me
    finally:
        a.close()
        b.close()
    r, w = os.pipe()
    try:
        assert slurm_pmi._pmi_server(r) is None  # not a socket
    finally:
        os.close(r)
        os.close(w)


def test_this_environment_has_the_wheel_with_ofi():
    # The project's venv installs the `mpich` wheel (ENVIRONMENT.md), which ships libfabric.
    assert slurm_pmi._wheel_has_ofi()
