"""A throwaway single-node Slurm cluster on localhost, for tests that submit real batch jobs.

    cluster = SlurmCluster()
    cluster.start()          # install if missing (root + apt-get), configure, start, wait for idle
    job = cluster.sbatch("examples/slurm/train_srun.sbatch", out_dir=tmp)
    cluster.stop()           # scontrol shutdown, stop munged, check they are gone, restore config

What start() does (the recipe of shared/ENVIRONMENT.md, "Slurm, for real, on this machine"):

- `sbatch` missing: as root with apt-get, `apt-get install slurm-wlm munge` (retried); otherwise
  raise Unavailable, which the caller turns into a skip (or a failure under CI=true).
- munge: Debian's postinst creates /etc/munge/munge.key; if it is missing, `mungekey` makes one.
  /run/munge does not exist without systemd, so it is created; munged runs as user munge. A munged
  that is already running and answering is used as it is and left running at stop().
- /etc/slurm/slurm.conf: written with MARKER as its first line. A slurm.conf without the marker (not
  ours) is moved to slurm.conf.mpidp-backup and put back at stop(); ours is removed at stop().
- slurmctld is started with -c (clear saved state: no jobs or node states left from a previous
  run), then slurmd; start() returns once `sinfo` shows the node idle.
- A slurmctld/slurmd already running under a config of ours (left by a killed test run) is shut
  down and restarted; under a config that is not ours, start() refuses (Unavailable) rather than
  take over someone's cluster.
- One test cluster at a time per machine: start() waits (lock_timeout) for another test session's
  cluster to be stopped.

`SlurmCluster(nodes=[Node(name, address, enter), ...], controller_address=...)` makes one
slurmd per node instead, each started behind its `enter` argv prefix (into a namespace host of
multihost_cluster.py, say) with `slurmd -N name`, its spool /var/lib/slurm/slurmd/<name>, pid
file /run/slurmd-<name>.pid and log /var/log/slurm/slurmd-<name>.log; slurmctld stays here.

Only root can do any of this (config in /etc, daemons that run jobs as any user).
"""

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

from .cluster_kit import (
    DAEMON_ENV,
    ClusterError,
    SessionLock,
    Unavailable,
    alive,
    daemon_pids,
    install,
    is_root,
    kill_all,
    read_pid,
    run_group,
    tail,
    wait_until,
    wait_while,
    which,
)
from .cluster_kit import run as _run_any

MARKER = (
    "# Written by mpidp's tests/integration/slurm_cluster.py for a test cluster; safe to delete."
)
CONF = Path("/etc/slurm/slurm.conf")
BACKUP = Path("/etc/slurm/slurm.conf.mpidp-backup")
STATE_DIRS = ("/var/lib/slurm/slurmctld", "/var/lib/slurm/slurmd", "/var/log/slurm")
SLURMCTLD_LOG = Path("/var/log/slurm/slurmctld.log")
SLURMD_LOG = Path("/var/log/slurm/slurmd.log")
PIDFILES = {
    "slurmctld": Path("/run/slurmctld.pid"),
    "slurmd": Path("/run/slurmd.pid"),
    "munged": Path("/run/munge/munged.pid"),
}
MUNGE_KEY = Path("/etc/munge/munge.key")
MUNGE_DIRS = ("/run/munge", "/var/log/munge", "/var/lib/munge")
LOCK = Path("/run/mpidp-slurm-test.lock")  # cluster_kit.SessionLock

PACKAGES = ("slurm-wlm", "munge")


class SlurmError(ClusterError):
    """Slurm is there but did not start or stop as expected; the message carries the logs."""


_run = functools.partial(_run_any, error=SlurmError)


def missing_programs():
    return [
        p
        for p in (
            "sbatch",
            "srun",
            "sinfo",
            "scontrol",
            "scancel",
            "slurmctld",
            "slurmd",
            "munged",
            "munge",
            "unmunge",
        )
        if which(p) is None
    ]


def node_name():
    return socket.gethostname().split(".")[0]  # `hostname -s`


def cpu_count():
    _, out = _run(["nproc"])  # what `nproc` says (the affinity mask), as slurmd will see it
    try:
        return int(out.strip())
    except ValueError:
        return os.cpu_count() or 1


def real_memory_mb():
    """A bit under the machine's memory: slurmd drains a node that has less than configured."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total_mb = int(line.split()[1]) // 1024
                return max(256, min(total_mb - 512, int(total_mb * 0.9)))
    return 1024


class Node:
    """A slurmd of a multi-node test cluster: its NodeName, the address slurmctld and srun reach
    it at, and the argv prefix that runs a command on it (in its namespaces, say)."""

    def __init__(self, name, address, enter=()):
        self.name = name
        self.address = address
        self.enter = list(enter)

    def __repr__(self):
        return f"<node {self.name} {self.address}>"


def slurmd_log(node=None):
    return SLURMD_LOG if node is None else SLURMD_LOG.with_name(f"slurmd-{node}.log")


def slurm_conf(host, cpus, memory_mb, nodes=None, controller_address=None):
    """One node named `host` on this machine; or, with `nodes`, one slurmd per Node, whose
    spool, pid and log paths then carry the node name (%n), as they share one file system."""
    ctld = f"{host}({controller_address})" if controller_address else host
    if nodes:
        spool, pidfile = "/var/lib/slurm/slurmd/%n", "/run/slurmd-%n.pid"
        log = slurmd_log("%n")
        node_lines = "".join(
            f"NodeName={n.name} NodeAddr={n.address} CPUs={cpus} "
            f"RealMemory={memory_mb} State=UNKNOWN\n"
            for n in nodes
        )
        names = ",".join(n.name for n in nodes)
    else:
        spool, pidfile, log = "/var/lib/slurm/slurmd", PIDFILES["slurmd"], SLURMD_LOG
        node_lines = f"NodeName={host} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN\n"
        names = host
    return f"""{MARKER}
ClusterName=mpidp-test
SlurmctldHost={ctld}
SlurmUser=root
AuthType=auth/munge
MpiDefault=pmi2
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir={spool}
SlurmctldPidFile={PIDFILES["slurmctld"]}
SlurmdPidFile={pidfile}
SlurmctldLogFile={SLURMCTLD_LOG}
SlurmdLogFile={log}
# Finished jobs are forgotten after 5 s instead of 300: `sbatch --wait` sleeps 2 s between polls
# and quadruples that while it is under MinJobAge/2, so with 300 a 20 s job is noticed after 42 s;
# with 5 it polls every 2 s.
MinJobAge=5
{node_lines}PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP \
OverSubscribe=FORCE:4
"""


def _is_ours(path):
    try:
        with open(path) as f:
            return f.readline().rstrip("\n") == MARKER
    except OSError:
        return False


class Job:
    """What `sbatch --wait` returned: the job id, its exit code, and the job's output file(s)."""

    def __init__(self, job_id, returncode, sbatch_output, output, error, seconds):
        self.job_id = job_id
        self.returncode = returncode
        self.sbatch_output = sbatch_output
        self.output = output  # the -o file
        self.error = error  # the -e file, if one was asked for
        self.seconds = seconds

    def __repr__(self):
        return (
            f"<job {self.job_id}: rc={self.returncode} in {self.seconds:.1f}s\n"
            f"--- sbatch:\n{self.sbatch_output}\n--- output:\n{self.output}\n"
            f"--- error:\n{self.error}>"
        )


class SlurmCluster:
    """One node on this machine, or with `nodes` (Node) one slurmd per node, each started with
    its Node.enter prefix; slurmctld runs here, and with `controller_address` the nodes reach it
    at that address (the machine's own name may resolve to loopback, which is not here for
    them)."""

    def __init__(self, log=None, nodes=None, controller_address=None):
        self.host = node_name()
        self.nodes = list(nodes or [])
        self.controller_address = controller_address
        self._log = log or (lambda msg: print(f"[slurm_cluster] {msg}", file=sys.stderr))
        self._started_munged = False
        self._conf_backed_up = False
        self._conf_written = False
        self._lock = SessionLock(LOCK, self._log)
        self.started = False

    # -- start -----------------------------------------------------------------------------

    def start(self, timeout=60, lock_timeout=900):
        """Install if needed, configure and start; return when the node is idle. Raises
        Unavailable (cannot be had here) or SlurmError (there but broken, with the logs)."""
        t0 = time.monotonic()
        if missing_programs():
            self._log(f"installing {' '.join(PACKAGES)} (missing: {', '.join(missing_programs())})")
            install(PACKAGES, missing_programs)
            self._log(f"installed in {time.monotonic() - t0:.1f}s")
        if not is_root():
            raise Unavailable(
                "a test Slurm cluster needs root (it writes /etc/slurm/slurm.conf "
                "and starts munged, slurmctld and slurmd)"
            )
        self._lock.acquire(lock_timeout)
        try:
            running = {d: daemon_pids(d) for d in ("slurmctld", "slurmd")}
            if any(running.values()) and not _is_ours(CONF):
                raise Unavailable(
                    f"Slurm daemons not started by these tests are running ({running}) under "
                    f"{CONF} that is not ours; not touching someone else's cluster"
                )
        except BaseException:
            self._lock.release()
            raise
        try:
            self._start_munge()
            if any(running.values()):
                self._log(f"daemons left by an earlier run {running}: shutting them down first")
                self._stop_slurm_daemons()
            self._write_conf()
            for d in STATE_DIRS:
                os.makedirs(d, exist_ok=True)
            for n in self.nodes:
                os.makedirs(f"/var/lib/slurm/slurmd/{n.name}", exist_ok=True)
            # Fresh logs, so that errors shown on failure are this run's.
            for log in (SLURMCTLD_LOG, *self._slurmd_logs()):
                with open(log, "w"):
                    pass
            self.started = True
            _run([which("slurmctld"), "-c"], env=DAEMON_ENV, check=True)
            if self.nodes:
                for n in self.nodes:
                    _run([*n.enter, which("slurmd"), "-N", n.name], env=DAEMON_ENV, check=True)
            else:
                _run([which("slurmd")], env=DAEMON_ENV, check=True)
            self._wait_idle(timeout)
        except BaseException:
            self.stop(check=False)
            raise
        self._log(f"node(s) {', '.join(self.node_names())} idle after {time.monotonic() - t0:.1f}s")

    def node_names(self):
        return [n.name for n in self.nodes] or [self.host]

    def _slurmd_logs(self):
        return [slurmd_log(n.name) for n in self.nodes] or [SLURMD_LOG]

    def _start_munge(self):
        for d in MUNGE_DIRS:
            os.makedirs(d, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        if not MUNGE_KEY.exists():
            self._log(f"{MUNGE_KEY} missing: creating one with mungekey")
            _run(
                [
                    which("mungekey") or "/usr/sbin/mungekey",
                    "--create",
                    "--keyfile",
                    str(MUNGE_KEY),
                ],
                check=True,
            )
            shutil.chown(MUNGE_KEY, "munge", "munge")
            os.chmod(MUNGE_KEY, 0o400)
        if self._munge_works():
            self._log("munged already running; using it (and leaving it running)")
            return
        stale = daemon_pids("munged")
        if stale:
            raise SlurmError(f"munged is running ({stale}) but does not answer `munge -n`")
        _run(["runuser", "-u", "munge", "--", which("munged")], env=DAEMON_ENV, check=True)
        self._started_munged = True
        if not wait_until(self._munge_works, 10):
            raise SlurmError(
                "munged started but `munge -n | unmunge` fails:\n"
                + tail("/var/log/munge/munged.log")
            )

    @staticmethod
    def _munge_works():
        try:
            cred = subprocess.run(
                [which("munge"), "-n"], capture_output=True, timeout=5, stdin=subprocess.DEVNULL
            )
            if cred.returncode != 0:
                return False
            return (
                subprocess.run(
                    [which("unmunge")], input=cred.stdout, capture_output=True, timeout=5
                ).returncode
                == 0
            )
        except (OSError, subprocess.TimeoutExpired):
            return False

    def _write_conf(self):
        CONF.parent.mkdir(parents=True, exist_ok=True)
        if BACKUP.exists() and (_is_ours(CONF) or not CONF.exists()):
            # A run that was killed before stop() left the original here: put it back at stop().
            self._log(f"{BACKUP} left by an earlier run: restoring it as {CONF} at the end")
            self._conf_backed_up = True
        elif CONF.exists() and not _is_ours(CONF):
            if BACKUP.exists():
                raise Unavailable(
                    f"{CONF} is not ours and {BACKUP} already exists; move one of them away by hand"
                )
            self._log(f"{CONF} is not ours: moving it to {BACKUP} until the tests end")
            os.rename(CONF, BACKUP)
            self._conf_backed_up = True
        text = slurm_conf(
            self.host, cpu_count(), real_memory_mb(), self.nodes, self.controller_address
        )
        tmp = CONF.with_name(CONF.name + ".tmp")
        tmp.write_text(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, CONF)
        self._conf_written = True

    def node_state(self, node=None):
        rc, out = _run(
            [which("sinfo"), "-h", "-N", "-n", node or self.host, "-o", "%T"], timeout=15
        )
        return out.strip() if rc == 0 else f"(sinfo rc={rc}: {out.strip()})"

    def _wait_idle(self, timeout):
        resumed = set()
        states = {}

        def idle():
            states.update((n, self.node_state(n)) for n in self.node_names())
            if all(state == "idle" for state in states.values()):
                return True
            for node, state in states.items():
                # A node remembered as drained/down needs a nudge (ReturnToService=2 covers
                # "down" after a restart, not an admin drain).
                if (
                    node not in resumed
                    and any(s in state for s in ("drain", "down"))
                    and "(" not in state
                ):
                    _run([which("scontrol"), "update", f"NodeName={node}", "State=RESUME"])
                    resumed.add(node)
            if not daemon_pids("slurmctld"):
                raise SlurmError(self._diagnostics(f"slurmctld is not running (nodes: {states})"))
            if len(daemon_pids("slurmd")) < len(self.node_names()):
                raise SlurmError(
                    self._diagnostics(
                        f"slurmd running {daemon_pids('slurmd')}, "
                        f"not one per node (nodes: {states})"
                    )
                )
            return False

        if not wait_until(idle, timeout, 0.5):
            raise SlurmError(
                self._diagnostics(f"node(s) not idle after {timeout}s (sinfo says {states})")
            )

    def _diagnostics(self, headline):
        _, info = _run([which("scontrol"), "show", "node", ",".join(self.node_names())], timeout=10)
        logs = "".join(f"\n--- {log}:\n{tail(log)}" for log in self._slurmd_logs())
        return (
            f"{headline}\n--- scontrol show node:\n{info}\n--- {SLURMCTLD_LOG}:\n"
            f"{tail(SLURMCTLD_LOG)}{logs}"
        )

    # -- jobs ------------------------------------------------------------------------------

    def sbatch(
        self, script, *args, out_dir, sbatch_args=(), env=None, timeout=180, separate_error=False
    ):
        """`sbatch --wait -o OUT_DIR/out.%j [-e OUT_DIR/err.%j] SBATCH_ARGS SCRIPT ARGS` from the
        repository root. On timeout the job is cancelled and TimeoutExpired re-raised."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        name = f"mpidp-test-{uuid.uuid4().hex[:8]}"  # to find the job again if we must cancel it
        cmd = [which("sbatch"), "--wait", "-J", name, "-o", str(out_dir / "out.%j")]
        if separate_error:
            cmd += ["-e", str(out_dir / "err.%j")]
        cmd += [*sbatch_args, str(script), *map(str, args)]
        try:
            proc = run_group(cmd, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            _run([which("scancel"), "-n", name], timeout=15)
            raise
        job_id = None
        for word in proc.stdout.split():
            if word.isdigit():
                job_id = word

        def read(prefix):
            if job_id is None:
                return ""
            try:
                return (out_dir / f"{prefix}.{job_id}").read_text(errors="replace")
            except OSError as e:
                return f"({prefix}.{job_id}: {e.strerror})"

        return Job(
            job_id,
            proc.returncode,
            proc.stdout + proc.stderr,
            read("out"),
            read("err") if separate_error else "",
            proc.seconds,
        )

    # -- stop ------------------------------------------------------------------------------

    def _stop_slurm_daemons(self, timeout=30):
        """scontrol shutdown; if a daemon outlives it, SIGTERM then SIGKILL it by its pid."""

        def running():
            return daemon_pids("slurmctld") + daemon_pids("slurmd")

        if daemon_pids("slurmctld"):
            _run([which("scontrol"), "shutdown"], timeout=15)
        if not wait_while(running, timeout):
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            self._log(f"slurmctld/slurmd {running()} outlived scontrol shutdown: {sig.name}")
            if kill_all(running(), sig, timeout=10):
                break

    def stop(self, check=True):
        """Stop what start() started and put the config back. With check, raise SlurmError if a
        daemon we started is still running afterwards."""
        problems = []
        if self.started:
            self._stop_slurm_daemons()
            self.started = False
        munged_pid = None
        if self._started_munged:
            munged_pid = read_pid(PIDFILES["munged"])
            _run(["runuser", "-u", "munge", "--", which("munged"), "--stop"], timeout=15)
            if munged_pid is not None and not wait_until(lambda: not alive(munged_pid), 10):
                self._log(f"munged (pid {munged_pid}) outlived munged --stop: SIGKILL")
                kill_all([munged_pid])
            self._started_munged = False
        for d in ("slurmctld", "slurmd"):
            if daemon_pids(d):
                problems.append(f"{d} still running: {daemon_pids(d)}")
        if munged_pid is not None and alive(munged_pid):
            problems.append(f"munged (pid {munged_pid}) still running")
        if self._conf_written:
            if _is_ours(CONF):
                CONF.unlink()
            self._conf_written = False
        if self._conf_backed_up:
            os.rename(BACKUP, CONF)
            self._conf_backed_up = False
        self._lock.release()
        if problems and check:
            raise SlurmError("; ".join(problems))
