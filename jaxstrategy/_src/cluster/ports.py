"""Ports for the jobs `run_local_workers` starts on this machine, held until each job ends.

A job's coordinator binds its port seconds after the port is chosen, and a port merely free then
could meanwhile go to another job started at the same time: the two would fail or join each
other's processes. So each port is reserved below the kernel's ephemeral range and guarded by an
exclusive `flock` until its job ends (docs/internals.md, "The cluster", gives the rules).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

# Where the lock files are. The name predates this module (the test suite's own picker used it),
# and is kept so that runs of older checkouts on this machine and this one exclude each other.
_LOCK_DIRECTORY = Path(tempfile.gettempdir()) / f"jaxstrategy-test-ports-{os.getuid()}"
# The lowest port tried; below it are many well-known services' ports.
_FIRST_PORT = 20_000
# How many ports the kernel is asked for, once the ports below its ephemeral range are all taken.
_KERNEL_PORT_TRIES = 200


def _ephemeral_ports_start() -> int:
    """The lowest port the kernel picks for `bind(0)` and outgoing connections (Linux's default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ports_below_ephemeral() -> Iterable[int]:
    """The ports tried first; none where the ephemeral range starts below `_FIRST_PORT`."""
    return range(_FIRST_PORT, min(_ephemeral_ports_start(), 32_768))


def _all_addresses_socket() -> socket.socket:
    """A TCP socket to bind on every address, as a job's coordinator binds: JAX's distributed
    service listens on `[::]:port`, IPv4 included where the machine has dual-stack IPv6."""
    if socket.has_dualstack_ipv6():
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        return sock
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


def _kernel_chosen_ports() -> Iterator[int]:
    """Ports the kernel picks for `bind(0)` on every address, free when picked."""
    for _ in range(_KERNEL_PORT_TRIES):
        with _all_addresses_socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        yield port  # Once closed, so that the probe can bind it.


def _bindable(port: int) -> bool:
    with _all_addresses_socket() as probe:
        # As the coordinator's service binds: a port left in TIME_WAIT by a job that just
        # ended is free for the next one (one that another program listens on is not).
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError:
            return False
    return True


class PortReservation:
    """Distinct TCP ports that no other reservation, in any process, holds until `release()`.

    Use it as a context manager, or call `release()` once the job using the ports has ended
    (calling it again does nothing).
    """

    def __init__(self, ports: list[int], descriptors: list[int]):
        self.ports = tuple(ports)
        self._descriptors = descriptors  # The lock files, open and locked.
        self._mutex = threading.Lock()

    def release(self) -> None:
        """Let the ports go: another reservation can take them from now on."""
        with self._mutex:
            descriptors, self._descriptors = self._descriptors, []
        for descriptor in descriptors:
            os.close(descriptor)  # Which drops its lock.

    def __enter__(self) -> PortReservation:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def __repr__(self) -> str:
        state = "released" if not self._descriptors else "held"
        return f"PortReservation(ports={list(self.ports)!r}, {state})"


def reserve_ports(count: int, *, caller: str = "reserve_ports()") -> PortReservation:
    """Reserve `count` distinct ports for a job on this machine (see docs/internals.md, "The cluster").

    Args:
      count: how many ports.
      caller: the call to name in an error.

    Raises:
      RuntimeError: no port is left, neither below the kernel's ephemeral range nor among
        those the kernel picks.
    """
    _LOCK_DIRECTORY.mkdir(exist_ok=True)
    ports: list[int] = []
    descriptors: list[int] = []
    try:
        for _ in range(count):
            port, descriptor = _reserve_one(caller)
            ports.append(port)
            descriptors.append(descriptor)
    except BaseException:
        for descriptor in descriptors:
            os.close(descriptor)
        raise
    return PortReservation(ports, descriptors)


def _reserve_one(caller: str) -> tuple[int, int]:
    """A free port and the open descriptor of its lock file, locked."""
    for candidates in (_ports_below_ephemeral(), _kernel_chosen_ports()):
        for port in candidates:
            descriptor = os.open(_LOCK_DIRECTORY / str(port), os.O_RDONLY | os.O_CREAT, 0o600)
            try:
                # Refused too where this process (another reservation, or an earlier port of
                # this one) holds the lock: it belongs to the open file, not the process.
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # Another job holds it.
                os.close(descriptor)
                continue
            if not _bindable(port):  # Some other program listens there.
                os.close(descriptor)
                continue
            return port, descriptor
    raise RuntimeError(
        f"{caller}: no port is left for a local job: every port from {_FIRST_PORT} up to the "
        f"kernel's ephemeral range, and each of {_KERNEL_PORT_TRIES} ports the kernel picked, is "
        f"held by another local job (their lock files are in {_LOCK_DIRECTORY}) or used by another "
        "program. Let running jobs end, or free some ports."
    )
