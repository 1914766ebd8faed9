"""The port picker of `run_local_workers`: ports locked for a job until it ends.

Where the kernel's ephemeral range starts below 20000 (`ip_local_port_range` of `1024 65535`)
there are no ports below it to take; the picker then takes the ports the kernel picks, still
guarded by its lock files, so that two jobs are never handed the same port. Two reservations in
this process exclude each other as two processes do (flock locks belong to an open file).
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator

import pytest

from jaxstrategy._src.cluster import ports


@pytest.fixture
def no_ports_below_ephemeral(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ports, "_ports_below_ephemeral", lambda: range(20_000, 1024))


@pytest.fixture
def reserve() -> Iterator[Callable[[int], tuple[int, ...]]]:
    """Reserves ports as a job would; lets them go after the test."""
    made = []

    def make(count: int) -> tuple[int, ...]:
        made.append(ports.reserve_ports(count))
        return made[-1].ports

    yield make
    for reservation in made:
        reservation.release()


def _assert_bindable(port: int) -> None:
    with ports._all_addresses_socket() as sock:
        sock.bind(("", port))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.usefixtures("no_ports_below_ephemeral")
def test_with_no_port_below_the_ephemeral_range_the_kernel_picks_distinct_ones(reserve):
    taken = reserve(2) + reserve(1) + reserve(1)
    assert len(set(taken)) == 4, taken
    for port in taken:
        _assert_bindable(port)


@pytest.mark.usefixtures("no_ports_below_ephemeral")
def test_a_port_the_kernel_picks_twice_goes_to_one_job_only(reserve, monkeypatch):
    (taken,) = reserve(1)  # One job's; the next is another job's, as far as the locks go.
    picks = iter([taken])

    def picks_taken_first():
        # The kernel picks the port the first job holds, then whatever it picks.
        yield from picks
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        yield port

    monkeypatch.setattr(ports, "_kernel_chosen_ports", picks_taken_first)
    (other,) = reserve(1)
    assert other != taken
    _assert_bindable(other)


def test_once_the_ports_below_the_ephemeral_range_are_taken_the_kernel_picks(reserve, monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        # The only port below the range is in use by another program.
        monkeypatch.setattr(ports, "_ports_below_ephemeral", lambda: range(busy_port, busy_port + 1))
        taken = reserve(2)
    assert busy_port not in taken and len(set(taken)) == 2, taken
    for port in taken:
        _assert_bindable(port)


def test_a_released_port_can_be_reserved_again(monkeypatch):
    with ports.reserve_ports(1) as first:
        (port,) = first.ports
        monkeypatch.setattr(ports, "_ports_below_ephemeral", lambda: [port])
        monkeypatch.setattr(ports, "_kernel_chosen_ports", lambda: iter([]))
        with pytest.raises(RuntimeError, match=r"reserve_ports\(\): no port is left for a local job"):
            ports.reserve_ports(1)  # Held by the first.
    first.release()  # Again: nothing.
    assert repr(first) == f"PortReservation(ports=[{port}], released)"
    with ports.reserve_ports(1) as again:
        assert again.ports == (port,) and repr(again) == f"PortReservation(ports=[{port}], held)"


def test_when_no_port_is_left_the_error_says_what_holds_them(monkeypatch):
    monkeypatch.setattr(ports, "_ports_below_ephemeral", lambda: range(20_000, 1024))
    monkeypatch.setattr(ports, "_KERNEL_PORT_TRIES", 0)
    with pytest.raises(RuntimeError, match=r"^f\(\): no port is left for a local job") as err:
        ports.reserve_ports(1, caller="f()")
    message = str(err.value)
    assert "every port from 20000 up to the kernel's ephemeral range" in message
    assert re.search(r"their lock files are in .*jaxstrategy-test-ports-\d+\)", message)
    assert "Let running jobs end, or free some ports." in message


def test_a_failed_reservation_lets_go_of_the_ports_it_had_taken(monkeypatch):
    with ports.reserve_ports(1) as probe:
        (port,) = probe.ports
    monkeypatch.setattr(ports, "_ports_below_ephemeral", lambda: [port])
    monkeypatch.setattr(ports, "_kernel_chosen_ports", lambda: iter([]))
    with pytest.raises(RuntimeError, match=r"no port is left"):
        ports.reserve_ports(2)  # Takes `port`, then finds no second one.
    with ports.reserve_ports(1) as again:
        assert again.ports == (port,)
