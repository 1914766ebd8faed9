"""Each private orbax name in `orbax_compat` resolves on the installed orbax, to what the fallback says.

An orbax upgrade that moves or changes one fails `test_resolves_through_its_first_path_to_its_fallback`
by name (names are looked up among the modules `import orbax.checkpoint` loads). The log filter
of failed writes is installed when a checkpoint is first written to, not on import.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import types
from pathlib import Path

import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest

from jaxstrategy._src.core import orbax_compat

ENTRIES = {
    "tmp_dir_suffix": (orbax_compat.TMP_DIR_SUFFIX_PATHS, orbax_compat.TMP_DIR_SUFFIX_FALLBACK),
    "pytree_metadata_file": (
        orbax_compat.PYTREE_METADATA_FILE_PATHS,
        orbax_compat.PYTREE_METADATA_FILE_FALLBACK,
    ),
    "default_item_name": (orbax_compat.DEFAULT_ITEM_NAME_PATHS, orbax_compat.DEFAULT_ITEM_NAME_FALLBACK),
    "read_coroutine": (orbax_compat.READ_COROUTINE_PATHS, orbax_compat.READ_COROUTINE_FALLBACK),
}


@pytest.mark.parametrize(("paths", "fallback"), ENTRIES.values(), ids=ENTRIES.keys())
def test_resolves_through_its_first_path_to_its_fallback(paths, fallback):
    found = orbax_compat.lookup(paths)
    version = ocp.__version__
    assert found is not None, f"orbax {version} has none of {paths}: update orbax_compat.py"
    assert found[0] == paths[0], f"orbax {version} moved {paths[0]}: update orbax_compat.py"
    value = getattr(found[1], "__qualname__", found[1])
    assert value == fallback, f"orbax {version} changed {paths[0]} to {value!r}: update orbax_compat.py"


def test_the_names_are_what_orbax_writes(tmp_path):
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "item", {"w": jnp.ones(2)})
    assert (tmp_path / "item" / orbax_compat.PYTREE_METADATA_FILE).is_file()
    with ocp.CheckpointManager(tmp_path / "managed") as manager:
        manager.save(3, args=ocp.args.StandardSave({"w": jnp.ones(2)}))
        manager.wait_until_finished()
    assert (tmp_path / "managed" / "3" / orbax_compat.DEFAULT_ITEM_NAME).is_dir()
    # Orbax says where it wrote the step before renaming it: the name of an unfinished save.
    record = (tmp_path / "managed" / "3" / orbax_compat.DEFAULT_ITEM_NAME / "commit_success.txt").read_text()
    written_in = Path(record.split(" to ", 1)[1].strip()).parent.name
    assert written_in.startswith("3") and orbax_compat.UNFINISHED_STEP.fullmatch(written_in), record
    assert orbax_compat.UNFINISHED_STEP.fullmatch(f"12{orbax_compat.TMP_DIR_SUFFIX}-1700000000")
    assert not orbax_compat.UNFINISHED_STEP.fullmatch("3")


@types.coroutine
def _suspended():
    yield


def _suspended_read(name: str):
    """A coroutine named `name`, suspended, that raises when it is closed, as orbax's reads do."""

    async def read():
        try:
            await _suspended()
        finally:
            raise RuntimeError("a read closed unfinished")

    read.__qualname__ = name
    coroutine = read()
    coroutine.send(None)
    return coroutine


def test_the_reads_orbax_abandons_are_collected_without_a_word_and_others_still_reported(monkeypatch):
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: reported.append(unraisable.object))

    def fail_while_reading(*coroutines):
        raise ValueError("another read failed")

    abandoned, unrelated = _suspended_read(orbax_compat.READ_COROUTINE), _suspended_read("something_else")
    try:
        fail_while_reading(abandoned, unrelated)
    except ValueError as error:
        del abandoned, unrelated  # Held now only by the frame in the error's traceback, as orbax's are.
        orbax_compat.drop_abandoned_reads(error)
    assert [getattr(thing, "__qualname__", None) for thing in reported] == ["something_else"]
    assert sys.unraisablehook is not orbax_compat.drop_abandoned_reads  # Put back.


@pytest.mark.slow
def test_the_log_filter_is_installed_by_the_first_writer_not_by_import(tmp_path):
    script = textwrap.dedent(
        f"""
        import jaxstrategy, jaxstrategy.checkpoint as checkpoint
        from jaxstrategy._src.core import orbax_compat
        def filters():
            return [type(f).__name__ for f in orbax_compat.logger().filters]
        print('filters:', filters())
        checkpoint.Checkpointer({str(tmp_path)!r}).close()
        print('filters:', filters())
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    printed = [line for line in result.stdout.splitlines() if line.startswith("filters:")]
    assert printed == ["filters: []", "filters: ['_OrbaxFailureFilter']"], result.stdout + result.stderr


def test_written_parts_are_what_orbax_writes_replica_parallel(cpu_devices):
    # Orbax's replica-parallel save: each of the 4 copies of a replicated array writes a quarter.
    assert orbax_compat.lookup(orbax_compat.REPLICA_SLICES_PATHS)[0] == orbax_compat.REPLICA_SLICES_PATHS[0]
    import jax
    import numpy as np

    mesh = jax.sharding.Mesh(np.array(cpu_devices[:4]), ("x",))
    array = jax.device_put(
        np.arange(24.0).reshape(8, 3), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    )
    parts = orbax_compat.written_parts(array)
    assert sorted((index[0].start, index[0].stop) for index, _, _ in parts) == [
        (0, 2),
        (2, 4),
        (4, 6),
        (6, 8),
    ]
    for index, data, within in parts:
        assert np.array_equal(np.asarray(data)[within], np.asarray(array)[index])
