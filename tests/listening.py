"""Which TCP sockets a set of processes listens on, read from /proc (Linux): ``/proc/<pid>/fd`` names each socket's
inode, ``/proc/<pid>/net/tcp{,6}`` (the table of the process's network namespace) gives its state and address."""

from __future__ import annotations

import ipaddress
import os
import socket
import struct

LISTEN = "0A"


def process_tree(root: int) -> list[int]:
    """``root`` and every process descended from it."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, []))
    return tree


def _address(hex_addr: str) -> str:
    if len(hex_addr) == 8:
        return socket.inet_ntoa(struct.pack("<I", int(hex_addr, 16)))
    words = [struct.pack("<I", int(hex_addr[i : i + 8], 16)) for i in range(0, 32, 8)]
    address = ipaddress.IPv6Address(b"".join(words))
    return str(address.ipv4_mapped or address)  # an IPv4 address on a dual-stack socket reads as itself


def listening_table(pid: int) -> dict[int, tuple[str, int]]:
    """{inode: (address, port)} of every listening TCP socket in ``pid``'s network namespace."""
    table = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{name}") as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            addr, port = fields[1].split(":")
            table[int(fields[9])] = (_address(addr), int(port, 16))
    return table


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def listening_sockets(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every listening TCP socket the processes hold."""
    found = []
    for pid in pids:
        table = listening_table(pid)
        for inode in socket_inodes(pid):
            if inode in table:
                found.append((pid, *table[inode]))
    return found
