"""The root conftest.py's port picker, which gives the local jobs of tests their ports.

Where the kernel's ephemeral range starts below 20000 (`ip_local_port_range` of `1024 65535`)
there are no ports below it to take; the picker then takes the ports the kernel picks, still
guarded by its lock files, so that two test processes are never handed the same port.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from jaxstrategy._src.cluster import local_workers

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def conftest_module(pytestconfig: pytest.Config) -> ModuleType:
    """The root conftest.py (a plugin; `import conftest` could find tests/conftest.py instead)."""
    root_conftest = ROOT / "conftest.py"
    (module,) = [
        plugin
        for plugin in pytestconfig.pluginmanager.get_plugins()
        if isinstance(plugin, ModuleType) and getattr(plugin, "__file__", None) == str(root_conftest)
    ]
    assert isinstance(local_workers.free_ports, module._PortReserver), "the picker is not in use"
    return module


@pytest.fixture
def no_ports_below_ephemeral(conftest_module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest_module, "_ports_below_ephemeral", lambda: range(20_000, 1024))


@pytest.fixture
def new_reserver(conftest_module: ModuleType) -> Iterator[object]:
    """Makes pickers as another test process would have; lets their ports go afterwards."""
    made = []

    def make() -> object:
        made.append(conftest_module._PortReserver())
        return made[-1]

    yield make
    for reserver in made:
        for descriptor in reserver._held:
            os.close(descriptor)


def _assert_bindable(conftest_module: ModuleType, port: int) -> None:
    with conftest_module._all_addresses_socket() as sock:
        sock.bind(("", port))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


@pytest.mark.usefixtures("no_ports_below_ephemeral")
def test_with_no_port_below_the_ephemeral_range_the_kernel_picks_distinct_ones(conftest_module, new_reserver):
    reserver = new_reserver()
    ports = reserver(2) + reserver(1) + reserver(1)
    assert len(set(ports)) == 4, ports
    for port in ports:
        _assert_bindable(conftest_module, port)


@pytest.mark.usefixtures("no_ports_below_ephemeral")
def test_a_port_the_kernel_picks_twice_goes_to_one_process_only(conftest_module, new_reserver, monkeypatch):
    first, second = new_reserver(), new_reserver()  # Two test processes, as far as the locks go.
    (taken,) = first(1)
    picks = iter([taken])

    def picks_taken_first():
        # The kernel picks the port the first process holds, then whatever it picks.
        yield from picks
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        yield port

    monkeypatch.setattr(conftest_module, "_kernel_chosen_ports", picks_taken_first)
    (other,) = second(1)
    assert other != taken
    _assert_bindable(conftest_module, other)


def test_once_the_ports_below_the_ephemeral_range_are_taken_the_kernel_picks(
    conftest_module, new_reserver, monkeypatch
):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        busy_port = busy.getsockname()[1]
        # The only port below the range is in use by another program.
        monkeypatch.setattr(
            conftest_module, "_ports_below_ephemeral", lambda: range(busy_port, busy_port + 1)
        )
        ports = new_reserver()(2)
    assert busy_port not in ports and len(set(ports)) == 2, ports
    for port in ports:
        _assert_bindable(conftest_module, port)
