"""UCX's TCP segment: set before MPI starts unless the user set it; read back from the library's
version text and the environment; and the engine's long sleeps only where it is large and the
link was measured slow."""

import pytest

from mpidp.engine import link, mpi, mpi_library
from mpidp.runtime import ucx_segment

MPICH_UCX = "MPICH Version:      5.0.2\nMPICH Device:       ch4:ucx ofi\nMPICH CC: cc\n"
MPICH_OFI = "MPICH Version:      4.2.0\nMPICH Device:       ch4:ofi\n"
OPEN_MPI = "Open MPI v5.0.5, package: Open MPI ..., Ident string: 5.0.5"


def test_prepare_sets_two_mebibytes_where_nothing_is_set():
    env = {}
    assert ucx_segment.prepare(env) is True
    assert env == {"UCX_TCP_RX_SEG_SIZE": "2m"}
    assert mpi_library.ucx_tcp_segment(MPICH_UCX, env) == 2 << 20


def test_prepare_keeps_what_the_user_set():
    env = {"UCX_TCP_RX_SEG_SIZE": "128kb"}
    assert ucx_segment.prepare(env) is False
    assert env == {"UCX_TCP_RX_SEG_SIZE": "128kb"}
    assert mpi_library.ucx_tcp_segment(MPICH_UCX, env) == 128 << 10


@pytest.mark.parametrize(
    "given, want",
    [("65536", 65536), ("512k", 512 << 10), ("2MB", 2 << 20), ("1g", 1 << 30), ("4b", 4)],
)
def test_ucx_memory_units(given, want):
    assert mpi_library.ucx_tcp_segment(MPICH_UCX, {"UCX_TCP_RX_SEG_SIZE": given}) == want


@pytest.mark.parametrize("given", ["auto", "inf", "", "m", "2 tb", "-1"])
def test_a_segment_that_is_not_a_size_counts_as_unknown(given):
    assert mpi_library.ucx_tcp_segment(MPICH_UCX, {"UCX_TCP_RX_SEG_SIZE": given}) == 0


def test_unset_is_ucxs_own_64_kib():
    assert mpi_library.ucx_tcp_segment(MPICH_UCX, {}) == 64 << 10


@pytest.mark.parametrize(
    "version, env",
    [
        (MPICH_OFI, {}),
        (OPEN_MPI, {}),
        (MPICH_UCX, {"MPICH_CH4_NETMOD": "ofi"}),
        (MPICH_UCX, {"MPIR_CVAR_CH4_NETMOD": "OFI"}),
    ],
)
def test_no_segment_where_ucx_does_not_carry_the_traffic(version, env):
    env = dict(env, UCX_TCP_RX_SEG_SIZE="2m")
    assert mpi_library.ucx_tcp_segment(version, env) == 0


def test_a_netmod_chosen_as_ucx_counts():
    env = {"MPIR_CVAR_CH4_NETMOD": "ucx", "UCX_TCP_RX_SEG_SIZE": "2m"}
    assert mpi_library.ucx_tcp_segment(MPICH_UCX, env) == 2 << 20


def test_long_sleeps_only_on_a_slow_link_with_large_reads():
    pace = link.LinkPace(None, measure=False)
    big, small = 2 << 20, 64 << 10
    assert pace.slow is None  # not measured: the short sleeps, whatever the segment
    assert pace.sleep_max(big) == mpi.NETWORK_SLEEP_MAX_S
    pace.slow = False
    assert pace.sleep_max(big) == mpi.NETWORK_SLEEP_MAX_S
    pace.slow = True
    assert pace.sleep_max(big) == mpi.NETWORK_SLEEP_LONG_S
    assert pace.sleep_max(small) == mpi.NETWORK_SLEEP_MAX_S
    assert pace.sleep_max(0) == mpi.NETWORK_SLEEP_MAX_S
    assert mpi.NETWORK_SLEEP_MAX_S < mpi.NETWORK_SLEEP_LONG_S
