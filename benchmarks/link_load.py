"""Traffic at the link's rate without MPI: what moving bytes costs the cores, and the floor it sets.

On the test cluster every host is a network namespace on the same cores, so the kernel's work
for each byte (copies, TCP, the veth pair, the shaper) is taken from the compute of both hosts.
LinkLoad keeps every link busy in both directions with plain blocking sockets between ranks on
different hosts (the least CPU TCP needs to move the bytes here), so that cluster_step.py can
time the compute alone and under that load in the same job; floor() turns those timings into
the least step time any data-parallel library can reach.
"""

import socket
import threading

_BLOCK = 1 << 20


def peers(comm, hostnames):
    """(to, from): the ranks this rank sends to and receives from, the same position on the
    next and the previous host (ring over hosts); (None, None) on one host or with no partner."""
    hosts = sorted(set(hostnames))
    if len(hosts) < 2:
        return None, None
    mine = hostnames[comm.rank]
    on = {h: [r for r, name in enumerate(hostnames) if name == h] for h in hosts}
    here = on[mine].index(comm.rank)
    h = hosts.index(mine)
    nxt, prv = on[hosts[(h + 1) % len(hosts)]], on[hosts[h - 1]]
    return (nxt[here] if here < len(nxt) else None), (prv[here] if here < len(prv) else None)


class LinkLoad:
    """One TCP connection from each rank to its peer on the next host; while on(), a thread
    sends as fast as the link takes it and another drains what arrives. Collective: every rank
    constructs it (addresses are exchanged), and every rank calls close()."""

    def __init__(self, comm, address, hostnames):
        to, frm = peers(comm, hostnames)
        listener = socket.socket()
        listener.bind((address, 0))
        listener.listen(1)
        ports = comm.allgather((address, listener.getsockname()[1]))
        self._out = self._in = None
        if to is not None:
            self._out = socket.create_connection(ports[to])
        if frm is not None:
            self._in, _ = listener.accept()
        listener.close()
        comm.Barrier()
        self._go = threading.Event()
        self._closing = False
        self._threads = []
        if self._out is not None:
            self._threads.append(threading.Thread(target=self._send, daemon=True))
        if self._in is not None:
            self._threads.append(threading.Thread(target=self._drain, daemon=True))
        for t in self._threads:
            t.start()

    def _send(self):
        block = bytes(_BLOCK)
        while True:
            self._go.wait()
            if self._closing:
                return
            self._out.sendall(block)

    def _drain(self):
        buf = bytearray(_BLOCK)
        while self._in.recv_into(buf):
            pass

    def on(self):
        self._go.set()

    def off(self):
        self._go.clear()

    def close(self):
        self._closing = True
        self._go.set()
        if self._out is not None:
            self._out.shutdown(socket.SHUT_WR)
        for t in self._threads:
            t.join(timeout=10)
        for s in (self._out, self._in):
            if s is not None:
                s.close()


def floor(forward, backward, backward_loaded, update, t_comm, t_last=0.0, ready=()):
    """The least step time with `t_comm` seconds of link traffic, `t_last` of them the transfer
    of the gradient the backward pass produces last: nothing crosses before the backward pass
    produces gradients, the last one only after it ends, and the update waits for it, so
    forward and update run with the link idle; while the link is busy the backward pass runs at
    the speed it had under LinkLoad (backward / backward_loaded), the rest of it at full speed:
    forward + update + max(t_comm, backward + (t_comm - t_last) * (1 - speed) + t_last).
    `ready`: (seconds into the backward pass at which a gradient is ready, seconds its transfer
    takes) for every gradient, from a backward pass without traffic. A gradient cannot cross
    before it is ready, so whatever is ready at t or later still has to cross after t: the
    link's traffic ends no sooner than max over t of t + the transfers of the gradients ready
    at t or later (a model whose large gradients come late, as the MLP's, cannot hide its
    backward pass behind the link)."""
    speed = backward / backward_loaded if backward_loaded > 0 else 1.0
    early = t_comm - t_last
    inner = max(t_comm, backward + early * (1.0 - speed) + t_last)
    later = 0.0
    for at, cost in sorted(ready, reverse=True):
        later += cost
        inner = max(inner, at + later)
    return forward + update + inner
