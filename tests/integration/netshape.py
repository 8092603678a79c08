"""Shaped links for the multi-host test cluster: rate, latency and loss with `tc`, and a probe that
measures what a link really carries.

A host of the cluster (multihost_cluster.py) reaches the bridge through a veth pair: `eth0` in the
host's namespace, the host's veth in the root namespace. `tc` shapes what a device sends, so a
profile puts the same qdiscs on both ends (eth0: traffic from the host; the veth: traffic to it):

    htb root, default class 1:10 at the profile's rate
        leaf of 1:10: a byte fifo (or netem with the delay, where the kernel has it)
        class 1:20 (loss only): leaf fifo of length 0, which drops every packet it is given;
        a classic-BPF filter (cls_bpf, `ld rand`) sends a random fraction of packets there

A packet from one host to another leaves through the sender's eth0 and the receiver's veth, two
shaped devices in series: the rate is the profile's, and each device adds half the profile's
one-way delay and loses 1 - sqrt(1 - loss) of the packets, so host to host the one-way delay and
the loss are the profile's. Between a host and the bridge's address a packet crosses one shaped
device. `check` (multihost_cluster.py) measures both kinds of path.

Delay needs netem, and this machine's kernel is built without it (no CONFIG_NET_SCH_NETEM: tc
answers "Specified qdisc kind is unknown"; nor sch_fq, which honours eBPF departure times). Here a
profile's delay is therefore not added: the links have the stack's own latency, about 20 us round
trip host to host as the probe measures it (Python TCP ping-pong, median), and `delay_s` is the
nominal figure of the network the profile stands for. On a kernel with netem, the delay is added.

Shaped profiles set the MTU of the bridge and veths to 9000 (jumbo frames, as on cluster
networks). A lossy profile also sets `gso_max_segs 1`, so the qdiscs see one frame per packet and
lose single frames, as a wire does, not 64 KB segmentation bursts; that costs CPU, so the other
profiles allow segments of up to a quarter of the htb burst (at 10 Gbit/s one frame per packet
costs a third of the rate on two cores; segments larger than the burst let htb exceed a low rate
by 10 %).

    python tests/integration/netshape.py serve ADDR PORT SECONDS    # the probe's ends (internal)
    python tests/integration/netshape.py send ADDR PORT SECONDS PINGS TIMEOUT
"""

import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
from typing import NamedTuple, Optional

JUMBO = 9000
PLAIN = 1500


class Profile(NamedTuple):
    """A link as seen host to host: rate each way (bit/s, None: unshaped), one-way delay (s),
    fraction of packets lost one way, and the MTU."""

    rate_bit_s: Optional[float]
    delay_s: float
    loss: float
    mtu: int


PROFILES = {
    "none": Profile(None, 0.0, 0.0, PLAIN),
    "100mbe": Profile(100e6, 50e-6, 0.0, JUMBO),
    "1gbe": Profile(1e9, 50e-6, 0.0, JUMBO),
    "10gbe": Profile(10e9, 20e-6, 0.0, JUMBO),
    "lossy": Profile(1e9, 50e-6, 0.005, JUMBO),
    "1mbit": Profile(1e6, 50e-6, 0.0, JUMBO),  # a link gone bad (fault tests)
}


def profile(spec, base=None) -> Profile:
    """A Profile from a name in PROFILES, a Profile, or a dict of fields replacing those of `base`
    (by default the unshaped profile): {"rate_bit_s": 1e6}."""
    if isinstance(spec, Profile):
        return spec
    if isinstance(spec, str):
        if spec not in PROFILES:
            raise ValueError(f"unknown network profile {spec!r}; known: {', '.join(PROFILES)}")
        return PROFILES[spec]
    unknown = set(spec) - set(Profile._fields)
    if unknown:
        raise ValueError(f"unknown profile fields {sorted(unknown)}; known: {Profile._fields}")
    return (base or PROFILES["none"])._replace(**spec)


def _tc_argv(netns):
    tc = shutil.which("tc") or "tc"
    return [tc, "-n", netns] if netns else [tc]


def _ip_argv(netns):
    ip = shutil.which("ip") or "ip"
    return [ip, "-n", netns] if netns else [ip]


def _call(argv, check=True):
    proc = subprocess.run(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=30,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}: {proc.stdout.strip()}")
    return proc.stdout


def has_netem():
    """Whether this kernel has netem (delay); a kernel built without it rejects the qdisc kind."""
    try:
        import gzip

        with gzip.open("/proc/config.gz", "rt") as f:
            return any(line.startswith("CONFIG_NET_SCH_NETEM=") for line in f)
    except OSError:
        return True  # unknown: try, and let tc say


def applied(prof: Profile) -> Profile:
    """`prof` as this machine applies it: no delay where the kernel has no netem."""
    return prof if has_netem() or not prof.delay_s else prof._replace(delay_s=0.0)


def _loss_filter(loss):
    """Classic BPF for cls_bpf: a random 32-bit number below loss * 2**32 returns -1 (the filter's
    class, which drops), else 0 (no match: the default class)."""
    threshold = min(int(loss * 2**32), 2**32 - 1)
    rand = 2**32 - 0x1000 + 56  # SKF_AD_OFF + SKF_AD_RANDOM
    return f"4,32 0 0 {rand},53 1 0 {threshold},6 0 0 {2**32 - 1},6 0 0 0"


def qdisc_commands(dev, prof: Profile, netns=None, netem=None):
    """The tc command lines that give `dev`'s egress half of `prof` (see the module docstring);
    none for an unshaped profile. An htb root: class 1:10 (the default) holds the rate, its leaf
    a byte fifo or, for a delay where the kernel has netem, netem; for loss, a classic-BPF filter
    sends packets at random to class 1:20, whose fifo holds nothing (drops all)."""
    if prof.rate_bit_s is None and prof.delay_s == 0 and prof.loss == 0:
        return []
    netem = has_netem() if netem is None else netem
    tc = [*_tc_argv(netns)]
    rate = prof.rate_bit_s or 100e9
    burst = _burst(prof)
    limit = max(int(rate / 8 * 1e-2), 256 * 1024)  # queue: 10 ms at the rate, at least 256 KB
    htb = [f"{int(rate)}bit", "burst", str(burst), "cburst", str(burst)]
    cmds = [
        [*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
        [
            *tc,
            "class",
            "add",
            "dev",
            dev,
            "parent",
            "1:",
            "classid",
            "1:10",
            "htb",
            "rate",
            *htb[:1],
            "ceil",
            *htb,
        ],
    ]
    if prof.delay_s and netem:
        cmds.append(
            [
                *tc,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:10",
                "handle",
                "10:",
                "netem",
                "delay",
                f"{prof.delay_s / 2 * 1e6:.1f}us",
                "limit",
                "100000",
            ]
        )
    else:
        cmds.append(
            [
                *tc,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:10",
                "handle",
                "10:",
                "bfifo",
                "limit",
                str(limit),
            ]
        )
    if prof.loss:
        cmds += [
            [
                *tc,
                "class",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "classid",
                "1:20",
                "htb",
                "rate",
                "1mbit",
            ],
            [
                *tc,
                "qdisc",
                "add",
                "dev",
                dev,
                "parent",
                "1:20",
                "handle",
                "20:",
                "pfifo",
                "limit",
                "0",
            ],
            [
                *tc,
                "filter",
                "add",
                "dev",
                dev,
                "parent",
                "1:",
                "prio",
                "1",
                "bpf",
                "bytecode",
                _loss_filter(1 - math.sqrt(1 - prof.loss)),
                "classid",
                "1:20",
            ],
        ]
    return cmds


def _burst(prof: Profile):
    """htb's burst: 1 ms at the rate, at least a few frames."""
    return max(int((prof.rate_bit_s or 100e9) / 8 * 1e-3), 4 * prof.mtu)


def _gso_segments(prof: Profile):
    """Frames per packet the kernel may hand the qdiscs: one where frames are lost at random;
    else at most a quarter of a burst (htb lets larger packets exceed a low rate)."""
    if prof.loss:
        return 1
    if prof.rate_bit_s is None:
        return 65535
    return max(1, _burst(prof) // (4 * prof.mtu))


def shape_device(dev, prof: Profile, netns=None):
    """Replace whatever shapes `dev` (in `netns`, or the root namespace) by `prof`."""
    _call([*_tc_argv(netns), "qdisc", "del", "dev", dev, "root"], check=False)
    segs = str(_gso_segments(prof))
    _call([*_ip_argv(netns), "link", "set", "dev", dev, "mtu", str(prof.mtu), "gso_max_segs", segs])
    for argv in qdisc_commands(dev, prof, netns):
        _call(argv)


def set_mtu(dev, mtu, netns=None):
    _call([*_ip_argv(netns), "link", "set", "dev", dev, "mtu", str(mtu)])


def qdiscs(dev, netns=None):
    """`tc qdisc show` for `dev`, one line per qdisc."""
    return _call([*_tc_argv(netns), "qdisc", "show", "dev", dev], check=False).strip()


# -- the probe -------------------------------------------------------------------------------------
# A one-stream TCP transfer and a TCP ping-pong between two namespaces: the far end runs this file
# as `serve` inside the destination's namespace, the near end runs `send` inside the source's.

_CHUNK = 1 << 20
_SKIP = 0.25  # the first quarter of a transfer (slow start, the htb burst) is not timed


def _serve(addr, port, seconds):
    """Accept connections until one says 'Q': on 'R' receive a stream for `seconds`, print its
    steady rate as JSON and close (the sender stops at the reset: what it still had buffered is
    never waited for); on 'P' echo single bytes."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((addr, port))
    srv.listen(4)
    srv.settimeout(60)
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        mode = conn.recv(1)
        if mode == b"Q":
            return
        if mode == b"P":
            while b := conn.recv(1):
                conn.sendall(b)
        elif mode == b"R":
            conn.settimeout(seconds)
            buf = bytearray(_CHUNK)
            t0 = time.monotonic()
            total, marks = 0, []  # (time, bytes so far)
            while (now := time.monotonic()) < t0 + seconds:
                try:
                    n = conn.recv_into(buf)
                except socket.timeout:
                    break
                if not n:
                    break
                total += n
                marks.append((now, total))
            t1, last = marks[-1] if marks else (t0, 0)
            first = next((m for m in marks if m[0] >= t0 + _SKIP * (t1 - t0)), (t1, last))
            rate = (last - first[1]) * 8 / max(t1 - first[0], 1e-9)
            # A receiver descheduled across the skip point (a loaded machine) reads what queued
            # meanwhile in one burst, and the tail's rate comes out up to 2x (19.9 Mbit/s at 10,
            # with the right byte count): the whole window's rate bounds it.
            rate = min(rate, last * 8 / max(t1 - t0, 1e-9))
            print(json.dumps({"rate_bit_s": rate, "bytes": total}), flush=True)
        conn.close()


def _send(addr, port, seconds, pings, timeout):
    """Stream until the far end closes (it times the stream), then `pings` round trips of one
    byte: {rtt_s, rtt_min_s} (nothing without pings)."""

    def connect(mode):
        s = socket.create_connection((addr, port), timeout=timeout)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.sendall(mode)
        return s

    out = {}
    if seconds > 0:
        s = connect(b"R")
        data = bytes(1 << 16)
        try:
            while True:
                s.sendall(data)
        except (ConnectionResetError, BrokenPipeError):
            pass
        s.close()
    if pings > 0:
        s = connect(b"P")
        times = []
        for _ in range(pings):
            t = time.perf_counter()
            s.sendall(b"x")
            s.recv(1)
            times.append(time.perf_counter() - t)
        s.close()
        out.update(rtt_s=statistics.median(times), rtt_min_s=min(times))
    connect(b"Q").close()
    return out


def _in(netns):
    """argv prefix that runs a command in `netns` (None: here)."""
    if netns is None:
        return []
    return [shutil.which("nsenter") or "nsenter", f"--net=/run/netns/{netns}"]


def probe(src_netns, dst_netns, dst_addr, seconds=0.6, pings=200, port=5399, timeout=30):
    """Measure from `src_netns` to `dst_addr` in `dst_netns` (None: the root namespace): one TCP
    stream's steady rate (bit/s, the receiver's count) and the median TCP round trip (s).
    RuntimeError if the far end cannot be reached or stops answering within `timeout` s."""
    me = os.path.abspath(__file__)
    server = subprocess.Popen(
        [*_in(dst_netns), sys.executable, me, "serve", dst_addr, str(port), str(seconds)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        stdin=subprocess.DEVNULL,
    )
    try:
        line = server.stdout.readline()
        if line.strip() != "listening":
            raise RuntimeError(
                f"probe server in {dst_netns} did not start: {line}{server.stderr.read()}"
            )
        client = subprocess.run(
            [
                *_in(src_netns),
                sys.executable,
                me,
                "send",
                dst_addr,
                str(port),
                str(seconds),
                str(pings),
                str(timeout),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            stdin=subprocess.DEVNULL,
            timeout=2 * timeout + seconds,
        )
        if client.returncode != 0:
            raise RuntimeError(f"probe to {dst_addr} failed: {client.stderr.strip()}")
        out, _ = server.communicate(timeout=timeout)
        found = json.loads(client.stdout)
        for line in out.splitlines():
            found.update(json.loads(line))
        return found
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        _serve(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
    elif sys.argv[1] == "send":
        print(
            json.dumps(
                _send(
                    sys.argv[2],
                    int(sys.argv[3]),
                    float(sys.argv[4]),
                    int(sys.argv[5]),
                    float(sys.argv[6]),
                )
            )
        )
    else:
        sys.exit(__doc__)
