#!/usr/bin/env bash
# Runs a command with MPICH forced onto TCP between every pair of ranks, even on one host: a
# stand-in for a network between hosts. For the `mpich` wheel (MPICH 5, ch4 with the ucx and ofi
# netmods); other MPI libraries ignore these variables.
#
#   MPIR_CVAR_NOLOCAL=1       every rank acts as if on a node of its own: no shared-memory
#                             transport, and MPI_COMM_TYPE_SHARED splits give one rank each
#                             (so mpidp sees local_size() == 1, cross_size() == size())
#   MPIR_CVAR_CH4_NETMOD=ofi  the libfabric netmod; the wheel's default netmod, ucx, keeps using
#                             its own shared-memory transports under NOLOCAL (no TCP seen)
#   FI_PROVIDER=tcp           libfabric's tcp provider (tcp;ofi_rxm): one TCP connection per
#                             pair of ranks that talk, on the host's first interface (checked
#                             by tests/integration/test_tcp_transport.py)
#
# Usage: tests/run_tcp_env.sh CMD [ARGS...]    run CMD with these variables set
#        tests/run_tcp_env.sh                  print them as export lines (for eval or CI)
#   e.g. tests/run_tcp_env.sh timeout 900 .venv/bin/mpiexec -n 3 .venv/bin/python -m pytest \
#            --with-mpi -q -p no:cacheprovider --timeout=120 --timeout-method=thread tests/mpi

set -euo pipefail

export MPIR_CVAR_NOLOCAL=1
export MPIR_CVAR_CH4_NETMOD=ofi
export FI_PROVIDER=tcp

if [[ $# -eq 0 ]]; then
    for var in MPIR_CVAR_NOLOCAL MPIR_CVAR_CH4_NETMOD FI_PROVIDER; do
        echo "export $var=${!var}"
    done
    exit 0
fi
exec "$@"
