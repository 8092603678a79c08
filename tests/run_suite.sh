#!/usr/bin/env bash
# Runs mpidp's test stages, every one of them even after a failure, then prints one summary
# line per stage and exits non-zero if any stage failed.
#
#   tests/run_suite.sh [unit] [mpi] [variants] [integration]   (no argument: all, in that order)
#
# Stages:
#   unit         python -m pytest tests/unit                        (single process; beside the mpi
#                stage's first launch when mpi follows it)
#   mpi          mpiexec -n N python -m pytest --with-mpi tests/mpi  for each N in $NPS
#   variants     the collective suite ($VARIANT_TESTS) again on other data paths and transports:
#                MPIDP_BACKEND=gloo at n=3, hierarchical allreduce over simulated 2-rank nodes at
#                n=4 (less $HIER_SKIP), and MPICH forced onto TCP (tests/run_tcp_env.sh) at n=3;
#                under gloo and hierarchical, test_backends.py only its session-path test
#   integration  python -m pytest -n $INTEGRATION_WORKERS tests/integration   (tests launch mpiexec
#                themselves; pytest-xdist workers, the test clusters' tests taking turns on one)
#
# Environment knobs:
#   NPS="1 2 3 4"          world sizes for the mpi stage
#   INTEGRATION_WORKERS=2  pytest-xdist workers for the integration stage (0: one process, no xdist)
#   UNIT_TIMEOUT=900 MPI_TIMEOUT=900 INTEGRATION_TIMEOUT=1800   outer wall-clock limits (s)
#   OMP_NUM_THREADS        defaults to 1 in the mpi stage (N ranks share the cores)
#   VENV=.venv             its bin/ is put first in PATH if it exists
#   PYTEST_ADDOPTS         pytest's own: extra options for every stage (e.g. "-x -k allreduce")
#
# A stage whose directory holds no test files is SKIPPED without running pytest; pytest's exit
# code 5 ("no tests collected", e.g. everything deselected) is reported as NO TESTS, not a failure.

set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

VENV="${VENV:-$ROOT/.venv}"
if [[ -d "$VENV/bin" ]]; then
    export PATH="$(cd "$VENV/bin" && pwd):$PATH"
fi

NPS="${NPS:-1 2 3 4}"
UNIT_TIMEOUT="${UNIT_TIMEOUT:-900}"
MPI_TIMEOUT="${MPI_TIMEOUT:-900}"
INTEGRATION_TIMEOUT="${INTEGRATION_TIMEOUT:-1800}"
# Most of an integration test is waiting (launches, fault bounds, daemons): two workers keep both
# cores busy (here, both with other load on the machine: 996 s in one process, 706 s in two).
INTEGRATION_WORKERS="${INTEGRATION_WORKERS:-2}"

LOGDIR="$(mktemp -d "${TMPDIR:-/tmp}/mpidp-suite.XXXXXX")"
trap 'rm -rf "$LOGDIR"' EXIT

SUMMARY=()
FAILED=()

has_tests() {  # a directory with at least one test file in it
    [[ -d "$1" ]] && [[ -n "$(find "$1" -type f \( -name 'test_*.py' -o -name '*_test.py' \) -print -quit)" ]]
}

closing_line() {  # a pytest closing line from a log ("3 passed, 1 skipped in 2.10s"); with several
    # ranks, the last one that reports a failure or error, else the last one
    local lines bad
    lines="$(grep -E '([0-9]+ (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)|no tests ran).* in [0-9.]+s' "$1" \
        | sed -E 's/^.*(\[100%\]|\[ *[0-9]+%\])//; s/^=+ //; s/ =+$//')"
    bad="$(grep -E '[0-9]+ (failed|errors?)' <<<"$lines" | tail -n 1)"
    if [[ -n "$bad" ]]; then echo "$bad"; else tail -n 1 <<<"$lines"; fi
    if grep -q '^+\++ Timeout +\++$' "$1"; then echo " [pytest-timeout fired]"; fi
}

# Exit code 5 means "no tests collected" (nothing there, or all deselected). But hydra ORs the
# ranks' exit codes (1|4 == 5), so under mpiexec accept it only if every rank printed a closing
# line and none of them reports a failure or error.
no_tests_everywhere() {  # LOG NPROCS
    local lines
    lines="$(grep -E '([0-9]+ (passed|failed|skipped|deselected|xfailed|xpassed|errors?|warnings?)|no tests ran).* in [0-9.]+s' "$1")"
    [[ "$(grep -c . <<<"$lines")" -ge "$2" ]] && ! grep -qE '[0-9]+ (failed|passed|errors?)' <<<"$lines"
}

record() {  # record STAGE STATUS DETAIL
    SUMMARY+=("$(printf '%-14s %-8s %s' "$1" "$2" "$3")")
    if [[ "$2" == FAIL ]]; then FAILED+=("$1"); fi
}

# run_stage NAME NPROCS TIMEOUT CMD...   (NPROCS = ranks whose closing lines to expect, 1 if no MPI)
run_stage() {
    local name="$1"
    echo
    echo "==== [$name] ${*:4}"
    start_stage "$@"
    finish_stage "$name"
}

# start_stage NAME NPROCS TIMEOUT CMD...: the stage in the background, its output in its log only
# (finish_stage prints it); run_stage's foreground stages tee it as it comes.
declare -A STAGE_PID STAGE_START STAGE_NPROCS STAGE_LIMIT
start_stage() {
    local name="$1" nprocs="$2" limit="$3"
    shift 3
    local log="$LOGDIR/$name.log"
    : >"$log"
    STAGE_START[$name]=$SECONDS STAGE_NPROCS[$name]=$nprocs STAGE_LIMIT[$name]=$limit
    # On expiry timeout sends SIGTERM (SIGKILL 30 s later) to its process group. Hydra's proxies and
    # ranks setsid() out of that group; they go because mpiexec tears them down on SIGTERM (checked
    # with a hung barrier at np=3). A killed launch leaves a /dev/shm/mpich_shm_* segment behind.
    # stdin from /dev/null: hydra forwards stdin to rank 0, and CI has none.
    (timeout -k 30 "$limit" "$@" </dev/null >"$log" 2>&1; echo "$? $SECONDS" >"$log.rc") &
    STAGE_PID[$name]=$!
}

# finish_stage NAME: wait for a started stage (showing its log as it grows if it runs in the
# foreground) and record its result.
finish_stage() {
    local name="$1" log="$LOGDIR/$1.log" rc secs closing
    local nprocs="${STAGE_NPROCS[$1]}" limit="${STAGE_LIMIT[$1]}"
    tail -n +1 -s 0.2 -f --pid="${STAGE_PID[$name]}" "$log"
    wait "${STAGE_PID[$name]}"
    local ended
    read -r rc ended <"$log.rc" || { rc=1 ended=$SECONDS; }
    secs=$((ended - STAGE_START[$name]))  # its own time, also when it ran beside another stage
    closing="$(closing_line "$log" | tr -d '\n')"
    if [[ $rc -eq 0 ]]; then
        record "$name" PASS "(${secs}s) ${closing}"
    elif [[ $rc -eq 5 ]] && no_tests_everywhere "$log" "$nprocs"; then
        record "$name" "NO TESTS" "(${secs}s) pytest ran no test (exit 5) ${closing}"
    elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
        record "$name" FAIL "(${secs}s) TIMED OUT after ${limit}s (rc=$rc) ${closing}"
    else
        record "$name" FAIL "(${secs}s) rc=$rc ${closing}"
    fi
}

UNIT_PENDING=""

# stage_unit [background]: with `background` (the mpi stage follows), the unit tests run beside
# the mpi stage's first launch: one process each, on a 2-core machine about 20 s saved; the unit
# log is shown, and its result recorded, once that launch is done (finish_unit).
stage_unit() {
    if ! has_tests tests/unit; then record unit SKIP "no test files in tests/unit"; return; fi
    local cmd=(python -m pytest -q -p no:cacheprovider --timeout=300 --timeout-method=thread
               tests/unit)
    if [[ "${1:-}" == background ]]; then
        echo
        echo "==== [unit] ${cmd[*]} (beside the mpi stage's first launch; its log follows it)"
        start_stage unit 1 "$UNIT_TIMEOUT" "${cmd[@]}"
        UNIT_PENDING=1
    else
        run_stage unit 1 "$UNIT_TIMEOUT" "${cmd[@]}"
    fi
}

finish_unit() {
    if [[ -n "$UNIT_PENDING" ]]; then
        UNIT_PENDING=""
        echo
        echo "==== [unit] (run beside the mpi stage's first launch)"
        finish_stage unit
    fi
}

stage_mpi() {
    if ! has_tests tests/mpi; then record mpi SKIP "no test files in tests/mpi"; return; fi
    local n
    for n in $NPS; do
        OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" run_stage "mpi-np$n" "$n" "$MPI_TIMEOUT" \
            mpiexec -n "$n" python -m pytest --with-mpi -p no:cacheprovider -q \
            --timeout=120 --timeout-method=thread tests/mpi
        finish_unit
    done
    finish_unit
}

VARIANT_TESTS="${VARIANT_TESTS:-tests/mpi/test_allreduce.py tests/mpi/test_other_collectives.py \
tests/mpi/test_async_order.py tests/mpi/test_mismatch.py tests/mpi/test_join_barrier.py \
tests/mpi/test_autograd.py tests/mpi/test_optimizer.py tests/mpi/test_process_sets.py \
tests/mpi/test_backends.py tests/mpi/test_hierarchical.py tests/mpi/test_into_output.py \
tests/mpi/test_sharded.py tests/mpi/test_wire_cast.py}"

# Hierarchical allreduce changes the host path's allreduce and nothing else. These files move
# their data by reduce-scatter and allgather (the sharded optimizer, the into-output ops), which
# take the flat path there exactly as in mpi-np4; their few allreduces (join flags, a clipping
# norm) are grouped and bucket allreduces, which test_allreduce.py, test_join_barrier.py and
# test_optimizer.py (DistributedOptimizer's buckets) run there.
HIER_SKIP="${HIER_SKIP-tests/mpi/test_sharded.py tests/mpi/test_into_output.py}"

# test_backends.py builds its data paths (flat MPI, gloo, the staged twin) from explicit configs
# on communicators of its own, whatever MPIDP_BACKEND or the hierarchical variables say: under
# gloo and hierarchical it runs what mpi-np3 and mpi-np4 run, but for its test of the session's
# own path. Those two variants run that test alone; TCP (another transport under every path)
# runs the whole file.
SESSION_PATH_TEST="tests/mpi/test_backends.py::test_session_backend_runs_the_ops"

session_path_only() {  # the arguments, test_backends.py cut to SESSION_PATH_TEST
    local f
    for f in "$@"; do
        if [[ "$f" == tests/mpi/test_backends.py ]]; then echo "$SESSION_PATH_TEST"; else echo "$f"; fi
    done
}

stage_variants() {
    local pytest_mpi=(python -m pytest --with-mpi -p no:cacheprovider -q --timeout=120
                      --timeout-method=thread)
    local hier_tests=() gloo_tests=() f
    # shellcheck disable=SC2086  # VARIANT_TESTS is a list of paths
    mapfile -t gloo_tests < <(session_path_only $VARIANT_TESTS)
    for f in "${gloo_tests[@]}"; do
        if [[ " $HIER_SKIP " != *" $f "* ]]; then hier_tests+=("$f"); fi
    done
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MPIDP_BACKEND=gloo \
        run_stage "gloo-np3" 3 "$MPI_TIMEOUT" mpiexec -n 3 "${pytest_mpi[@]}" "${gloo_tests[@]}"
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" MPIDP_HIERARCHICAL_ALLREDUCE=1 \
        MPIDP_SIMULATED_LOCAL_SIZE=2 \
        run_stage "hier-np4" 4 "$MPI_TIMEOUT" mpiexec -n 4 "${pytest_mpi[@]}" "${hier_tests[@]}"
    # shellcheck disable=SC2086
    OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" \
        run_stage "tcp-np3" 3 "$MPI_TIMEOUT" bash tests/run_tcp_env.sh \
        mpiexec -n 3 "${pytest_mpi[@]}" $VARIANT_TESTS
}

stage_integration() {
    if ! has_tests tests/integration; then
        record integration SKIP "no test files in tests/integration"
        return
    fi
    local workers=()
    if [[ "$INTEGRATION_WORKERS" != 0 ]]; then
        workers=(-n "$INTEGRATION_WORKERS" --dist loadgroup)
    fi
    run_stage integration 1 "$INTEGRATION_TIMEOUT" \
        python -m pytest -q -p no:cacheprovider --timeout=600 --timeout-method=thread \
        "${workers[@]}" tests/integration
}

stages=("$@")
if [[ ${#stages[@]} -eq 0 ]]; then stages=(unit mpi variants integration); fi

echo "python:  $(command -v python) ($(python -V 2>&1))"
echo "mpiexec: $(command -v mpiexec || echo 'NOT FOUND')"
echo "NPS:     $NPS"

for i in "${!stages[@]}"; do
    stage="${stages[$i]}"
    case "$stage" in
        unit) if [[ "${stages[$((i + 1))]:-}" == mpi ]]; then stage_unit background; else stage_unit; fi ;;
        mpi) stage_mpi ;;
        variants) stage_variants ;;
        integration) stage_integration ;;
        *) echo "run_suite.sh: unknown stage '$stage' (want unit, mpi, variants, integration)" >&2; exit 2 ;;
    esac
done
finish_unit  # in case the mpi stage found no tests to run

echo
echo "==================== mpidp test summary ===================="
printf '%s\n' "${SUMMARY[@]}"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "run_suite: FAILED stages: ${FAILED[*]}"
    exit 1
fi
echo "run_suite: OK, no stage failed (${#SUMMARY[@]} stage(s))"
exit 0
