"""Test set-up shared by tests/ and the doctests in jaxstrategy/.

Four CPU devices are forced before JAX starts, so multi-device behaviour is tested on any
laptop; strict dtype promotion makes an accidental float64 or int/float mix fail loudly. The jobs
that tests start on 127.0.0.1 (`run_local_workers`) get ports that no other job, in this or any
other test process, can be given until they end (`jaxstrategy/_src/cluster/ports.py`), so the
suite can run in several processes at once (`make test` uses two).
"""

import os
import tempfile
from typing import Any

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Unless a launcher chose (the workers of tests/strategies/test_multi_worker.py run this suite with 2).
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]
    ).strip()

import jax  # noqa: E402  (must come after XLA_FLAGS is set)
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")

# The suite compiles many programs that an earlier test, or an earlier run, compiled already
# (each strategy's tests rebuild the same small steps as new functions, which jit's own caches do
# not share). JAX's persistent cache serves those repeats, shared by every test process of this
# machine's user (the pytest-xdist workers, the jobs they start) and kept between runs. With a
# size bound JAX takes a file lock (`filelock`, a test dependency) around each read and write,
# so the processes cannot race on an entry; entries are keyed by the program, the devices and
# JAX's version, so another checkout or version never reads a stale one.
_COMPILATION_CACHE = os.path.join(tempfile.gettempdir(), f"jaxstrategy-test-compilations-{os.getuid()}")
jax.config.update("jax_compilation_cache_dir", _COMPILATION_CACHE)
jax.config.update("jax_compilation_cache_max_size", 2 * 2**30)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


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
    "tests/checkpoint/test_checkpoints_across_processes.py",
    "tests/strategies/test_sharded_job.py",
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
