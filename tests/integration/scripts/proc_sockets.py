"""The inodes of this process's sockets, read from /proc (to find them in /proc/net tables)."""

import os


def socket_inodes() -> set:
    """Inode numbers (ints) of every socket this process holds open."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes
