"""Test set-up shared by tests/ and the doctests in jaxstrategy/.

Four CPU devices are forced before JAX starts, so multi-device behaviour is tested on any
laptop; strict dtype promotion makes an accidental float64 or int/float mix fail loudly. The jobs
that tests start on 127.0.0.1 get ports that no other test process can be given (see
`_PortReserver`), so the suite can run in several processes at once (`make test` uses two).
"""

import fcntl
import itertools
import os
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Unless a launcher chose (the workers of tests/strategies/test_multi_worker.py run this suite with 2).
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]
    ).strip()

import jax  # noqa: E402  (must come after XLA_FLAGS is set)
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# The suite compiles many programs that an earlier test compiled already (each strategy's tests
# rebuild the same small steps as new functions, which jit's own caches do not share). JAX's
# persistent cache, in a directory of this process's own (so that no two processes race on an
# entry), serves those repeats: `make test-fast` went from 62-67 s to 55-59 s on two cores.
_compilation_cache = tempfile.TemporaryDirectory(prefix="jaxstrategy-test-compilations-")
jax.config.update("jax_compilation_cache_dir", _compilation_cache.name)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def _ephemeral_ports_start() -> int:
    """The lowest port the kernel picks for `bind(0)` and outgoing connections (Linux's default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _ports_below_ephemeral() -> range:
    """The ports `_PortReserver` tries first; empty where the ephemeral range starts below 20000."""
    return range(20_000, min(_ephemeral_ports_start(), 32_768))


# How many ports the kernel is asked for, once the ports below its ephemeral range are all taken.
_KERNEL_PORT_TRIES = 200


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


class _PortReserver:
    """Ports for local jobs that no other process running this suite can be handed.

    `local_workers.free_ports` asks the kernel for ports free at that moment and lets them go; a
    job's coordinator binds its port seconds later, once its process has imported JAX. In
    between, a job that another pytest-xdist worker (or another session on this machine) starts
    could be given the same port, and the two jobs would fail or join each other's processes.
    So tests take ports below the kernel's ephemeral range, which neither `bind(0)` nor outgoing
    connections use, each guarded by an exclusive lock on a file that this process holds until
    it exits, and never hand out the same port twice. Every process tries the same ports in the
    same order (so a few lock files serve every session), skipping those locked or in use.

    Where there is no port below the range (it starts below 20000, as `1024 65535` does) or all
    are taken, the kernel picks them, as `free_ports` does: another program's connection
    could then take one before the job binds it, but the locks still keep test processes apart.
    """

    def __init__(self) -> None:
        self._directory = Path(tempfile.gettempdir()) / f"jaxstrategy-test-ports-{os.getuid()}"
        self._mutex = threading.Lock()  # The tf_parity jobs start from a background thread.
        self._held: list[int] = []  # File descriptors of the locks, kept open.
        self._candidates = iter(_ports_below_ephemeral())

    def __call__(self, count: int) -> list[int]:
        with self._mutex:
            self._directory.mkdir(exist_ok=True)
            return [self._reserve_one() for _ in range(count)]

    def _reserve_one(self) -> int:
        for port in itertools.chain(self._candidates, _kernel_chosen_ports()):
            descriptor = os.open(self._directory / str(port), os.O_RDONLY | os.O_CREAT, 0o600)
            try:
                # Also refused where this process holds the port's lock: flock locks belong to
                # the open file, not the process, so no port is handed out twice.
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # Another test process holds it.
                os.close(descriptor)
                continue
            with _all_addresses_socket() as probe:
                try:
                    probe.bind(("", port))
                except OSError:  # Some other program listens there.
                    os.close(descriptor)
                    continue
            self._held.append(descriptor)
            return port
        raise RuntimeError(
            f"no port is left for local jobs: none below {_ephemeral_ports_start()}, and none of "
            f"{_KERNEL_PORT_TRIES} that the kernel picked"
        )


def pytest_configure(config: pytest.Config) -> None:
    # For the whole session, so that it covers doctests and the tf_parity jobs' thread too.
    from jaxstrategy._src.cluster import local_workers

    patch = pytest.MonkeyPatch()
    patch.setattr(local_workers, "free_ports", _PortReserver())
    config.add_cleanup(patch.undo)


@pytest.hookimpl(tryfirst=True)  # Before -m deselects.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the doctests that start jobs slow; in a pytest-xdist worker, puts slow tests first.

    xdist hands out tests in the order its workers collected them (after the groups of
    `_Scheduling`), so the slow ones start early and the fast ones fill in after them, and the
    workers end together. Without xdist the files keep their own order.
    """
    for item in items:
        if isinstance(item, pytest.DoctestItem) and any(
            "run_local_workers(" in example.source for example in getattr(item.dtest, "examples", [])
        ):
            item.add_marker(pytest.mark.slow)
    if hasattr(config, "workerinput"):
        # Stable; tests/tf_parity/ keeps its order, in which its jobs overlap its other tests.
        items.sort(key=lambda item: not item.get_closest_marker("slow") or _in_tf_parity(item.nodeid))


def _in_tf_parity(nodeid: str) -> bool:
    return nodeid.startswith("tests/tf_parity/")


# Modules whose slow tests share a module-scoped fixture that runs a job (a two-process job, a
# demo run): their test functions go to one worker, so that it runs once, not once per worker.
_MODULES_SHARING_A_JOB = (
    "tests/user_facing/test_demo.py",
    "tests/strategies/test_multi_worker.py",
    "tests/checkpoint/test_preemption.py",
)


@pytest.hookimpl(optionalhook=True)  # A pytest-xdist hook: without xdist, never called.
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`pytest -n N` (`make test`): xdist's one-test-at-a-time scheduling, with a few groups.

    A group runs in one worker. xdist's own `xdist_group` marks would do, but pytest 9.2's node
    ids drop the group xdist appends to them (pytest-dev/pytest-xdist#1386), so the groups are
    told here, by node id:
    - the tests of tests/tf_parity/: the worker that runs the first of them runs the directory's
      two-process jobs (its session fixture), and in one group only one worker does;
    - the test functions of `_MODULES_SHARING_A_JOB`.
    Groups go out first, largest first; then single tests, in the order the workers collected.
    """
    if config.getvalue("dist") != "load":  # Another --dist was asked for.
        return None
    from xdist.scheduler import LoadScopeScheduling

    class _Scheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path, _, name = nodeid.partition("::")
            if _in_tf_parity(path):
                return "tests/tf_parity"
            if path in _MODULES_SHARING_A_JOB and "::" not in name:  # Not a class's tests.
                return path
            return nodeid

    return _Scheduling(config, log)
