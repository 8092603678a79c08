"""A throwaway cluster of several hosts on this machine (namespaces + sshd), for multi-host tests.

    cluster = MultiHostCluster()
    cluster.start()                      # namespaces, bridge, veths, one sshd per host
    res = cluster.mpiexec(["-hosts", "hosta:2,hostb:2", "-n", "4", python, script])
    cluster.stop()                       # kills everything on the hosts, removes it all

Each host is a network namespace (`ip netns`) with its own address on a bridge in the root
namespace (a veth pair each), running sshd in its own UTS namespace, so `hostname` there says
hosta, hostb, ... The file system, /dev/shm, the process table and the kernel are shared: the
checkout and its venv are at the same path on every host, as on a cluster with a shared FS.
The hosts' names resolve to their addresses everywhere through lines added to /etc/hosts (marked,
taken out at stop), as a cluster's DNS would have them.

Launches reach the hosts as on a real cluster, through hydra's ssh launcher, with these settings
in the environment (`env()`):
- HYDRA_LAUNCHER_EXEC: an ssh wrapper using a private ssh config (the throwaway key, host-key
  checking off, host aliases -> addresses). A real user puts the same in ~/.ssh/config.
- HYDRA_IFACE=<bridge>: the proxies connect back to mpiexec at the bridge's address (the
  machine's own host name resolves to loopback, which is another place inside a namespace).
- UCX_TLS=self,tcp: UCX (the mpich wheel's netmod) decides that two processes share a machine by
  the kernel's boot id, which every namespace shares, and would carry cross-host traffic over
  SysV shared memory and CMA. Restricted to tcp it goes over the bridge as between real hosts.
  Ranks on one host still use MPICH's own shared memory: MPICH's locality is hydra's host list.

Everything is named with PREFIX, so start() removes what a killed run left (namespaces, links,
their processes, its temporary directory) before building; a lock serialises test sessions.
Only root can do this; `Unavailable` says why it cannot be had (the caller skips, or fails
under CI=true).
"""

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from . import netshape
from .cluster_kit import (
    ClusterError,
    SessionLock,
    Unavailable,
    alive,
    cmdline,
    descendants,
    install,
    is_root,
    kill_all,
    run,
    run_group,
    start_or_skip,
    tail,
    wait_until,
    wait_while,
    which,
)
from .launch import ROOT, mpiexec

PREFIX = "mpidpmh"  # namespaces mpidpmh-hostX, links mpidpmh*, /tmp/mpidpmh-*
BRIDGE = PREFIX + "0"
SUBNET = "10.215.15"  # a private /24 that lives only on our bridge; .1 is the bridge
HOST_NAMES = ("hosta", "hostb", "hostc")
LOCK = Path("/run/mpidp-multihost-test.lock")
PACKAGES = ("openssh-server", "openssh-client")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# " + PREFIX  # ends every line this module adds to HOSTS_FILE
# With no route out of the namespaces, nothing a host sends can leave the bridge's /24.
_SETUP_TIMEOUT = 30


def _run(cmd, timeout=_SETUP_TIMEOUT, check=True):
    return run(cmd, timeout, check=check)


def missing_programs():
    return [p for p in ("sshd", "ssh") if which(p) is None]


def namespaces():
    """Our network namespaces present now (ours or a killed run's)."""
    _, out = _run(["ip", "netns", "list"], check=False)
    return sorted(
        w
        for w in (line.split()[0] for line in out.splitlines() if line.strip())
        if w.startswith(PREFIX + "-")
    )


def links():
    """Our bridge and veth ends in the root namespace."""
    _, out = _run(["ip", "-o", "link", "show"], check=False)
    names = (
        line.split(":")[1].strip().split("@")[0]
        for line in out.splitlines()
        if line.count(":") >= 2
    )
    return sorted(n for n in names if n.startswith(PREFIX))


def pids_in(netns):
    """Live processes whose network namespace is `netns`."""
    rc, out = _run(["ip", "netns", "pids", netns], check=False)
    pids = [int(p) for p in out.split() if p.isdigit()] if rc == 0 else []
    return [p for p in pids if alive(p)]


def _host_name_lines(lines):
    """Write HOSTS_FILE in place: in a container it is often a bind mount, which a rename
    would fail to replace."""
    with open(HOSTS_FILE, "w") as f:
        f.writelines(lines)


def add_host_names(hosts):
    """Make the hosts' names resolve to their addresses, as a cluster's DNS does: hydra's
    proxies started by srun inside an allocation reach mpiexec by the name of the node it runs
    on. Lines marked with HOSTS_MARK; remove_everything() takes them out."""
    lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    _host_name_lines(lines + [f"{h.address} {h.name} {HOSTS_MARK}\n" for h in hosts])


def remove_host_names():
    try:
        lines = HOSTS_FILE.read_text().splitlines(keepends=True)
    except OSError:
        return
    kept = [line for line in lines if not line.rstrip().endswith(HOSTS_MARK)]
    if kept != lines:
        _host_name_lines(kept)


def remove_everything(log=lambda msg: None):
    """Kill every process on our hosts, delete our namespaces and links (ours or left over), and
    our lines in HOSTS_FILE."""
    remove_host_names()
    for ns in namespaces():
        pids = pids_in(ns)
        if pids:
            log(f"killing {len(pids)} process(es) on {ns}")
            kill_all(pids)
        _run(["ip", "netns", "del", ns], check=False)
    for link in links():
        _run(["ip", "link", "del", link], check=False)
    # Deleting a namespace frees its veth asynchronously.
    wait_while(lambda: namespaces() or links(), 10.0, 0.1)
    for path in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "-*")):
        # A directory bound onto itself is a mount os.path.ismount() does not see (same device).
        for _ in range(8):
            points = _mounts_under(path)
            if not points:
                break
            for point in sorted(points, reverse=True):
                _run(["umount", point], check=False)
        shutil.rmtree(path, ignore_errors=True)


def _mounts_under(path):
    """Mount points at or below `path`, from /proc/self/mounts (its octal escapes undone)."""
    try:
        with open("/proc/self/mounts") as f:
            points = [line.split()[1] for line in f if line.strip()]
    except OSError:
        return []
    decoded = (re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points)
    return [p for p in decoded if p == path or p.startswith(path + "/")]


class Host:
    def __init__(self, name, index):
        self.name = name
        self.netns = f"{PREFIX}-{name}"
        self.address = f"{SUBNET}.{index + 2}"
        self.veth = f"{PREFIX}-{name}"
        self.sshd = None  # Popen of its sshd (the listener)
        self.profile = netshape.PROFILES["none"]  # how its link is shaped now

    def __repr__(self):
        return f"<{self.name} {self.address}>"


class MultiHostCluster:
    def __init__(self, n_hosts=2, log=None, profile="none"):
        """`profile`: the links' shape from start (a name of netshape.PROFILES, a Profile, or a
        dict of Profile fields)."""
        if not 1 <= n_hosts <= len(HOST_NAMES):
            raise ValueError(f"n_hosts must be 1..{len(HOST_NAMES)}")
        self.hosts = [Host(name, i) for i, name in enumerate(HOST_NAMES[:n_hosts])]
        self.profile = netshape.profile(profile)
        self._log = log or (lambda msg: print(f"[multihost_cluster] {msg}", file=sys.stderr))
        self.dir = None
        self._lock = SessionLock(LOCK, self._log)
        self._old_sigterm = None

    # -- start ---------------------------------------------------------------------------------

    def start(self, lock_timeout=600):
        """Build the hosts and return once every sshd answers; Unavailable or ClusterError."""
        t0 = time.monotonic()
        if not is_root():
            raise Unavailable("a multi-host test cluster needs root (network namespaces, sshd)")
        for tool in ("ip", "unshare", "nsenter", "ssh-keygen"):
            if which(tool) is None:
                raise Unavailable(f"no `{tool}` here")
        if missing_programs():
            self._log(f"installing {' '.join(PACKAGES)}")
            install(PACKAGES, missing_programs)
        self._lock.acquire(lock_timeout)
        try:
            if namespaces() or links():
                self._log(f"left by an earlier run: {namespaces() + links()}; removing")
            remove_everything(self._log)
            self._catch_sigterm()
            self.dir = Path(tempfile.mkdtemp(prefix=PREFIX + "-"))
            self._make_shared_dir()
            self._write_keys_and_configs()
            self._build_network()
            add_host_names(self.hosts)
            for host in self.hosts:
                self._start_sshd(host)
            for host in self.hosts:
                self._wait_ssh(host)
        except BaseException:
            self.stop(check=False)
            raise
        self._log(f"{len(self.hosts)} hosts up in {time.monotonic() - t0:.1f}s: {self.hosts}")

    def _catch_sigterm(self):
        """`timeout` ends a test run with SIGTERM, which skips fixture teardown: stop first."""
        if threading_main() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:

            def on_term(signum, frame):
                self.stop(check=False)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.kill(os.getpid(), signal.SIGTERM)

            self._old_sigterm = signal.SIG_DFL
            signal.signal(signal.SIGTERM, on_term)

    @property
    def shared_dir(self) -> Path:
        """A directory whose mounts made later every host sees too (a small tmpfs there fills up
        for all of them, as a cluster's shared file system would)."""
        return self.dir / "shared"

    def _make_shared_dir(self):
        # Each host's sshd runs in a mount namespace of its own (`ip netns exec` makes one to
        # mount the namespace's /sys); made before them, a shared mount passes later mounts
        # beneath it on to theirs.
        path = str(self.shared_dir)
        os.mkdir(path)
        _run(["mount", "--bind", path, path])
        _run(["mount", "--make-shared", path])

    def _write_keys_and_configs(self):
        d = self.dir
        _run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "mpidp-test", "-f", str(d / "id")]
        )
        _run(
            [
                "ssh-keygen",
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "mpidp-test-host",
                "-f",
                str(d / "host_key"),
            ]
        )
        shutil.copy(d / "id.pub", d / "authorized_keys")
        aliases = "".join(f"Host {h.name}\n  HostName {h.address}\n" for h in self.hosts)
        (d / "ssh_config").write_text(
            aliases + f"Host *\n  User root\n  IdentityFile {d / 'id'}\n  IdentitiesOnly yes\n"
            "  StrictHostKeyChecking no\n  UserKnownHostsFile /dev/null\n  BatchMode yes\n"
            "  LogLevel ERROR\n  ConnectTimeout 10\n"
        )
        wrapper = d / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {which("ssh")} -F {d / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        for h in self.hosts:
            (d / f"sshd_{h.name}.conf").write_text(
                f"ListenAddress {h.address}\nPort 22\nHostKey {d / 'host_key'}\n"
                f"AuthorizedKeysFile {d / 'authorized_keys'}\nPermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
                # The keys live under /tmp, whose mode sshd's StrictModes refuses.
                f"StrictModes no\nPidFile {d / f'sshd_{h.name}.pid'}\nLogLevel ERROR\n"
                # sshd drops new connections at random beyond 10 unauthenticated ones (its
                # default 10:30:100); a cut link leaves the launcher's half-open ones behind.
                "MaxStartups 100\n"
            )

    def _build_network(self):
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for h in self.hosts:
            _run(["ip", "netns", "add", h.netns])
            _run(
                [
                    "ip",
                    "link",
                    "add",
                    h.veth,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    "eth0",
                    "netns",
                    h.netns,
                ]
            )
            _run(["ip", "link", "set", h.veth, "master", BRIDGE, "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.address}/24", "dev", "eth0"])
            _run(["ip", "-n", h.netns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
        self.shape(self.profile)

    # -- the network -----------------------------------------------------------------------------

    def shape(self, spec, hosts=None):
        """Shape the links of `hosts` (names; all by default) live: `spec` is a profile name, a
        Profile, or a dict of fields replacing those of each host's current profile
        ({"rate_bit_s": 1e6}). Both ends of each veth (netshape's docstring); the bridge takes
        the smallest MTU of its ports. Packets queued in the old qdiscs are dropped."""
        for h in self._hosts(hosts):
            prof = netshape.profile(spec, base=h.profile)
            netshape.shape_device(h.veth, prof)
            netshape.shape_device("eth0", prof, netns=h.netns)
            h.profile = prof
        mtus = {h.profile.mtu for h in self.hosts}
        netshape.set_mtu(BRIDGE, min(mtus))
        if self.dir is not None:
            (self.dir / "profiles.json").write_text(
                json.dumps({h.name: h.profile._asdict() for h in self.hosts})
            )
        self._log(
            "links: " + ", ".join(f"{h.name} {_describe(h.profile)}" for h in self._hosts(hosts))
        )

    def link_down(self, host):
        """Cut `host` off the bridge (its veth down: both ends lose carrier)."""
        _run(["ip", "link", "set", self.host(host).veth, "down"])

    def link_up(self, host, timeout=30):
        """Put `host` back on the bridge; return once its sshd answers through the link again
        (a launch right after `ip link set up` met "Connection reset by peer" in a CI run)."""
        _run(["ip", "link", "set", self.host(host).veth, "up"])
        self._wait_ssh(self.host(host), timeout)

    def check(self, seconds=0.6, pings=200):
        """Measure every host's link (a one-stream TCP transfer each way between the host and
        the bridge's address, and a TCP ping-pong), and the path from the first host to each
        other one; log and return {path: {"rate_bit_s", "rtt_s", "rtt_min_s", ...}}. Host to
        bridge crosses one shaped device (half the profile's one-way delay each way), host to
        host two."""
        bridge = f"{SUBNET}.1"
        found = {}
        for h in self.hosts:
            up = netshape.probe(h.netns, None, bridge, seconds, pings)
            down = netshape.probe(None, h.netns, h.address, seconds, 0)
            found[h.name] = dict(
                up,
                rate_bit_s=min(up["rate_bit_s"], down["rate_bit_s"]),
                rate_from_bit_s=up["rate_bit_s"],
                rate_to_bit_s=down["rate_bit_s"],
                profile=h.profile,
            )
        first = self.hosts[0]
        for h in self.hosts[1:]:
            pair = netshape.probe(first.netns, h.netns, h.address, seconds, pings)
            found[f"{first.name}->{h.name}"] = dict(pair, profile=h.profile)
        for path, m in found.items():
            rates = (
                f"from {_gbit(m['rate_from_bit_s'])} to {_gbit(m['rate_to_bit_s'])}"
                if "rate_from_bit_s" in m
                else _gbit(m["rate_bit_s"])
            )
            self._log(
                f"{path:14s} {rates}, RTT median {m['rtt_s'] * 1e6:.0f} us "
                f"(min {m['rtt_min_s'] * 1e6:.0f} us); profile {_describe(m['profile'])}"
            )
        return found

    def _hosts(self, names):
        return self.hosts if names is None else [self.host(n) for n in names]

    def _start_sshd(self, host):
        os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege-separation directory
        logf = open(self.dir / f"sshd_{host.name}.log", "w")
        script = (
            f"hostname {host.name} && exec {which('sshd')} -D -e "
            f"-f {self.dir / f'sshd_{host.name}.conf'}"
        )
        # ip netns exec, unshare and sh all exec, so the Popen's pid is sshd's own.
        host.sshd = subprocess.Popen(
            ["ip", "netns", "exec", host.netns, "unshare", "--uts", "sh", "-c", script],
            stdin=subprocess.DEVNULL,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        logf.close()

    def _wait_ssh(self, host, timeout=_SETUP_TIMEOUT):
        last = [None, ""]

        def answers():
            if host.sshd.poll() is not None:
                return True  # it exited: no use waiting
            last[:] = self.ssh(host.name, "hostname", check=False)
            return last[0] == 0 and last[1].strip() == host.name

        if wait_until(answers, timeout) and host.sshd.poll() is None:
            return
        raise ClusterError(
            f"ssh {host.name} did not answer within {timeout}s (last: {last[1]!r}; "
            f"sshd exit code {host.sshd.poll()}); sshd log:\n"
            f"{tail(self.dir / f'sshd_{host.name}.log')}"
        )

    # -- use -----------------------------------------------------------------------------------

    def host(self, name):
        return next(h for h in self.hosts if h.name == name)

    def enter(self, name):
        """The argv prefix that runs a command on host `name` as its sshd runs: in its network
        namespace, under its host name. nsenter rather than `ip netns exec`, which mounts a /sys
        of the namespace without the cgroup file systems under it (slurmd then stops at "No
        filesystem mounted on /sys/fs/cgroup")."""
        host = self.host(name)
        return [
            which("nsenter") or "nsenter",
            f"--net=/run/netns/{host.netns}",
            "unshare",
            "--uts",
            "sh",
            "-c",
            f'hostname {host.name} && exec "$@"',
            "sh",
        ]

    def ssh(self, host, command, timeout=30, check=True):
        return _run([str(self.dir / "ssh"), host, command], timeout=timeout, check=check)

    def env(self, **extra):
        """The environment for a launch across the hosts (see the module docstring)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
        env.update(
            HYDRA_LAUNCHER="ssh",
            HYDRA_LAUNCHER_EXEC=str(self.dir / "ssh"),
            HYDRA_IFACE=BRIDGE,
            UCX_TLS="self,tcp",
            OMP_NUM_THREADS="1",
        )
        env.update(extra)
        return env

    def run(self, cmd, timeout=120, env=None):
        """Run `cmd` (mpiexec or mpidprun, ...) from the repository root with env(); on timeout
        kill its process group (mpiexec and its ssh clients) and raise TimeoutExpired."""
        return run_group(cmd, timeout=timeout, env=env or self.env())

    def start_job(self, args, env=None):
        """mpiexec `args` in the background (own process group), stdout/stderr as text pipes."""
        return subprocess.Popen(
            [mpiexec(), *map(str, args)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=str(ROOT),
            env=env or self.env(),
            start_new_session=True,
        )

    def kill_session(self, name, with_children):
        """SIGKILL the sshd session processes on host `name` (not the listener), and with
        `with_children` everything they started; returns the pids killed."""
        host = self.host(name)
        pids = [
            p for p in pids_in(host.netns) if p != host.sshd.pid and cmdline(p).startswith("sshd: ")
        ]
        if with_children:
            pids = descendants(pids)
        kill_all(pids)
        return pids

    def mpiexec(self, *args, timeout=120, env=None):
        """The venv's hydra with `args` (hosts, -n, program...)."""
        return self.run([mpiexec(), *args], timeout=timeout, env=env)

    def leftovers(self, settle=5.0):
        """{host: [command line]} of processes other than the sshd listeners, after they have
        had `settle` seconds to go (sshd's session processes exit just after a job)."""

        def find():
            found = {}
            for h in self.hosts:
                keep = {h.sshd.pid} if h.sshd else set()
                rest = [p for p in pids_in(h.netns) if p not in keep]
                if rest:
                    found[h.name] = [f"{p}: {cmdline(p)}" for p in rest]
            return found

        return wait_while(find, settle, 0.1)

    # -- stop ----------------------------------------------------------------------------------

    def stop(self, check=True):
        """Kill everything on the hosts and remove the hosts; with check, raise ClusterError if
        a namespace or link survives."""
        for h in self.hosts:
            if h.sshd is not None:
                h.sshd.kill()
                h.sshd.wait(timeout=10)
                h.sshd = None
        remove_everything(self._log)
        left = namespaces() + links()
        self.dir = None
        if self._old_sigterm is not None and threading_main():
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None
        self._lock.release()
        if left and check:
            raise ClusterError(f"still present after stop: {left}")


def _gbit(rate):
    return f"{rate / 1e9:.3f} Gbit/s"


def _describe(prof):
    if prof.rate_bit_s is None and prof.delay_s == 0 and prof.loss == 0:
        return f"unshaped, MTU {prof.mtu}"
    rate = "unlimited" if prof.rate_bit_s is None else _gbit(prof.rate_bit_s)
    delay = f"{prof.delay_s * 1e6:.0f} us one way host to host"
    if netshape.applied(prof).delay_s != prof.delay_s:
        delay += " (not added: no netem in this kernel)"
    return f"{rate}, {delay}, loss {prof.loss * 100:g} %, MTU {prof.mtu}"


def threading_main():
    """signal.signal works only in the main thread."""
    return threading.current_thread() is threading.main_thread()


def attach(log=print):
    """The cluster that `up` left running (hosts, ssh directory, link profiles), not started here
    and holding no lock; ClusterError if none is up."""
    names = [ns[len(PREFIX) + 1 :] for ns in namespaces()]
    dirs = glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "-*"))
    if not names or len(dirs) != 1:
        raise ClusterError(f"no cluster is up (namespaces {names}, directories {dirs})")
    cluster = MultiHostCluster(len(names), log=log)
    if [h.name for h in cluster.hosts] != names:
        raise ClusterError(f"unexpected hosts {names}")
    cluster.dir = Path(dirs[0])
    saved = cluster.dir / "profiles.json"
    if saved.exists():
        for name, fields in json.loads(saved.read_text()).items():
            cluster.host(name).profile = netshape.Profile(**fields)
    return cluster


def main(argv):
    """python -m tests.integration.multihost_cluster
        up [N] [--profile P]   leave N hosts running, links shaped as P (netshape.PROFILES), and
                               print the environment to launch across them
        check                  measure each link of the running cluster (rate, round trip)
        shape P [HOST...]      reshape the running cluster's links (all, or those named)
        down                   remove it all
    (docs/clusters.md)"""
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m tests.integration.multihost_cluster", usage=main.__doc__
    )
    parser.add_argument("command", choices=("up", "check", "shape", "down"))
    parser.add_argument("args", nargs="*")
    parser.add_argument("--profile", default="none", choices=sorted(netshape.PROFILES))
    opts = parser.parse_args(argv)
    if opts.command == "down":
        remove_everything(print)
        return 0 if not (namespaces() or links()) else 1
    if opts.command == "check":
        attach().check()
        return 0
    if opts.command == "shape":
        if not opts.args:
            parser.error("shape needs a profile")
        attach().shape(opts.args[0], hosts=opts.args[1:] or None)
        return 0
    cluster = MultiHostCluster(
        int(opts.args[0]) if opts.args else 2, log=print, profile=opts.profile
    )
    cluster.start()
    for name, value in cluster.env().items():
        if name.startswith(("HYDRA_", "UCX_")):
            print(f"export {name}={value}")
    print("# hosts: " + " ".join(f"{h.name}={h.address}" for h in cluster.hosts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def started(n_hosts: int, what: str, profile="none") -> "MultiHostCluster":
    """A started cluster of `n_hosts` (links shaped as `profile`) for a test module's fixture;
    skips the module (fails it under CI=true) when one cannot be had here, and fails it when one
    does not start."""
    return start_or_skip(MultiHostCluster(n_hosts=n_hosts, profile=profile), what)
