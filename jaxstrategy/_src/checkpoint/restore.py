"""Reading a saved step back: onto any strategy's layout, checked against a target and checksums.

What `checkpointer.py`'s `restore` and `Checkpointer.restore` do once they know the step: check a
`target` against the step's metadata, leaf by leaf, then have orbax read every array directly onto
the target strategy's devices (`placement.py`), and check what was read (`verification.py`).
Directories written by orbax alone restore the same way. docs/internals.md ("Restoring onto any
layout") says how and why.
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from jaxstrategy._src.checkpoint import regions, stored_leaves, verification
from jaxstrategy._src.checkpoint.format import (
    PRNG_KEYS_ITEM,
    STATE_ITEM,
    STEP_NAME,
    ZERO_SIZE_SHAPES_ITEM,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    check_format,
    check_step,
    is_complete,
)
from jaxstrategy._src.checkpoint.placement import Placement
from jaxstrategy._src.cluster import coordination
from jaxstrategy._src.core import orbax_compat
from jaxstrategy._src.core.errors import bullet_list, caller_stacklevel
from jaxstrategy._src.core.tree_checks import PYTHON_SCALARS
from jaxstrategy._src.core.types import PyTree

# How orbax's read errors name the array they failed on: the key in its TensorStore spec.
_SPEC_PATH = re.compile(r"'path': '([^'/]+)/'")
# At most this many lines of leaf differences in one message; the rest are counted.
_MAX_LISTED = 20


def plain_orbax_items(directory: Path) -> dict[int | None, Path] | None:
    """The pytree items of a checkpoint written by orbax alone, by step; None for any other directory.

    `ocp.StandardCheckpointer().save(directory, tree)` makes `directory` itself the item (one
    checkpoint, under the key None); an `ocp.CheckpointManager` saving one item puts it in each
    step's `default/`. Orbax marks a pytree item by its `_METADATA` file. A directory holding any
    jaxstrategy step is not taken for one.
    """
    if not directory.is_dir():
        return None
    if (directory / orbax_compat.PYTREE_METADATA_FILE).is_file():
        return {None: directory}
    items = {}
    for entry in directory.iterdir():
        if not STEP_NAME.fullmatch(entry.name):
            continue
        if is_complete(entry):
            return None
        if (entry / orbax_compat.DEFAULT_ITEM_NAME / orbax_compat.PYTREE_METADATA_FILE).is_file():
            items[int(entry.name)] = entry / orbax_compat.DEFAULT_ITEM_NAME
    return dict(sorted(items.items())) or None


def plain_orbax_item(items: dict[int | None, Path], step: int | None, directory: Path) -> Path:
    """The item of `step` (the newest when None) among a plain orbax checkpoint's `items`."""
    if None in items:
        if step is not None:
            raise CheckpointNotFoundError(
                f"Checkpointer.restore(): {directory} is a single checkpoint written by orbax's "
                f"StandardCheckpointer, without steps, so it has no step {step!r}. Restore it with "
                "step=None."
            )
        return items[None]
    steps = list(items)
    if step is None:
        step = steps[-1]
    check_step(step, "Checkpointer.restore()")
    if step not in items:
        raise CheckpointNotFoundError(
            f"No checkpoint for step {step} in {directory}, written by orbax's CheckpointManager; "
            f"it holds steps {steps}."
        )
    return items[step]


def restore_item(item: Path, placement: Placement, target: PyTree) -> PyTree:
    """Restore a pytree item written by orbax alone (no PRNG keys or zero-size arrays in it)."""
    where = f"{item} (written by orbax alone)"
    handler = ocp.StandardCheckpointHandler()
    try:
        try:
            saved = handler.metadata(item)
        except Exception as error:
            raise CorruptCheckpointError(f"Cannot read the checkpoint at {where}: {error}") from error

        def read(abstract: PyTree) -> PyTree:
            return handler.restore(item, args=ocp.args.StandardRestore(abstract))

        return _restore_state(read, saved, {}, {}, placement, target, where)
    finally:
        handler.close()


def step_metadata(manager: ocp.CheckpointManager, step: int, where: str) -> Any:
    """Orbax's metadata of `step` (its items' metadata, its custom metadata), read once, the step
    checked to be of a format this version reads before anything else is read."""
    try:
        metadata = manager.metadata(step)
    except Exception as error:
        raise CorruptCheckpointError(f"Cannot read the checkpoint at {where}: {error}") from error
    check_format(metadata.custom_metadata, where)
    return metadata


def step_checksums(metadata: Any, step_directory: Path, where: str) -> verification.StepChecksums | None:
    """The checksums saved with the step, checked to be whole; None for a step saved before them."""
    try:
        return verification.load(step_directory, metadata.custom_metadata)
    except Exception as error:
        raise CorruptCheckpointError(f"Cannot read the checkpoint at {where}: {error}") from error


def restore_step(
    manager: ocp.CheckpointManager,
    metadata: Any,
    step: int,
    where: str,
    placement: Placement,
    target: PyTree,
    *,
    saved_checksums: verification.StepChecksums | None,
) -> PyTree:
    """Restore `step` of `manager`'s checkpoint (`metadata` its orbax metadata) by `placement`,
    shaped as `target` (the saved structure when None), checked against `saved_checksums`
    (those of the step, or None not to check)."""
    try:
        saved = metadata.item_metadata[STATE_ITEM]
        # Steps saved without zero-size arrays have no such item.
        items = {PRNG_KEYS_ITEM: ocp.args.JsonRestore()}
        if ZERO_SIZE_SHAPES_ITEM in metadata.item_metadata.keys():
            items[ZERO_SIZE_SHAPES_ITEM] = ocp.args.JsonRestore()
        values = manager.restore(step, args=ocp.args.Composite(**items))
        saved_regions = None
        if saved_checksums is not None:  # Before any of it is used.
            for item in items:
                saved_checksums.check_json(item, values[item])
            saved_regions = saved_checksums.leaf_regions(
                {
                    stored_leaves.path_string(path): tuple(meta.shape)
                    for path, meta in jax.tree_util.tree_flatten_with_path(saved)[0]
                }
            )
        prng_impls = values[PRNG_KEYS_ITEM] or {}
        shapes = values[ZERO_SIZE_SHAPES_ITEM] if ZERO_SIZE_SHAPES_ITEM in items else {}
        zero_size = {path: tuple(shape) for path, shape in shapes.items()}
    except Exception as error:
        raise CorruptCheckpointError(f"Cannot read the checkpoint at {where}: {error}") from error

    def read(abstract: PyTree) -> PyTree:
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardRestore(abstract)})
        return manager.restore(step, args=args)[STATE_ITEM]

    verify = None
    if saved_checksums is not None and saved_regions is not None:
        verify = functools.partial(
            _verify, saved_regions=saved_regions, sums=saved_checksums.sums, where=where
        )
    return _restore_state(read, saved, prng_impls, zero_size, placement, target, where, verify=verify)


def _restore_state(
    read: Callable[[PyTree], PyTree],
    saved: PyTree,
    prng_impls: dict[str, str],
    zero_size: dict[str, tuple[int, ...]],
    placement: Placement,
    target: PyTree,
    where: str,
    *,
    verify: Callable[[PyTree], None] | None = None,
) -> PyTree:
    """Check `target` against the `saved` orbax metadata, then `read` the arrays by `placement`.

    Each leaf goes where `placement` puts the target's leaf at its path, or without a target the
    saved leaf as it comes back. `verify`, when given, checks the leaves read as stored (PRNG keys
    as their data, 64-bit leaves before they are narrowed, zero-size arrays as their placeholders).
    """
    saved_leaves = {}
    for path, meta in jax.tree_util.tree_flatten_with_path(saved)[0]:
        name = stored_leaves.path_string(path)
        saved_leaves[name] = (zero_size.get(name, tuple(meta.shape)), np.dtype(meta.dtype))
    if target is None:
        placed = placement.shardings(_as_restored(saved, saved_leaves, prng_impls))

        def abstract_leaf(path: tuple[Any, ...], meta: Any) -> jax.ShapeDtypeStruct:
            sharding = placed[stored_leaves.path_string(path)]
            return jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=sharding)

        abstract = jax.tree_util.tree_map_with_path(abstract_leaf, saved)
    else:
        abstract = _abstract_target(target, saved_leaves, prng_impls, where, placement)
    # Where each leaf goes once restored, taken before zero-size leaves are replaced by scalars.
    shardings = {
        stored_leaves.path_string(path): leaf.sharding
        for path, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]
    }
    abstract = stored_leaves.as_stored(abstract, zero_size, placement.replicated)
    abstract = stored_leaves.wide_on_host(abstract)
    try:
        restored = jax.block_until_ready(
            read(abstract)
        )  # Read errors surface here, not in the caller's step.
    except Exception as error:
        orbax_compat.drop_abandoned_reads(error)
        raise CorruptCheckpointError(_read_failure(error, saved, where)) from error
    if verify is not None:
        verify(restored)
    # A zero-size leaf is still its scalar placeholder here, which cannot be split as the leaf is.
    placeholders = dict.fromkeys(zero_size, placement.replicated)
    restored = stored_leaves.narrow_wide(restored, shardings | placeholders, where)
    restored = stored_leaves.restore_zero_size(restored, zero_size, shardings)
    return stored_leaves.wrap_prng_keys(restored, prng_impls)


def _read_failure(error: Exception, saved: PyTree, where: str) -> str:
    """The message for orbax failing to read the arrays: the leaf (when its error names it) and why.

    Orbax wraps tensorstore's error (such as `ZSTD_decompressStream() failed`) in one that spells
    out the whole TensorStore spec; the leaf is the `'path'` of that spec, orbax's name for it.
    """
    cause: BaseException = error
    while cause.__cause__ is not None:
        cause = cause.__cause__
    names = {
        ".".join(stored_leaves.path_parts(path)): stored_leaves.path_string(path)
        for path, _ in jax.tree_util.tree_flatten_with_path(saved)[0]
    }
    leaves = {names[key] for key in _SPEC_PATH.findall(str(error)) if key in names}
    if len(leaves) != 1:
        return f"Cannot read the checkpoint at {where}: {cause}"
    return (
        f"Cannot read the checkpoint at {where}: the data of the leaf {leaves.pop()!r} cannot be "
        f"read, so its files were damaged or changed after the save ({cause}). Restore another step."
    )


def _verify(
    restored: PyTree,
    saved_regions: dict[str, dict[regions.Region, int]],
    sums: regions.RegionSums,
    where: str,
) -> None:
    """Raise, on every process of the job together, if the bytes `restored` differ from the
    `saved_regions`' checksums (summed as `sums` says); warn of regions left unchecked."""
    findings = verification.mismatches(restored, saved_regions, sums)
    damaged, unchecked = findings.damaged, findings.unchecked
    if any(
        not leaf.is_fully_addressable for leaf in jax.tree.leaves(restored) if isinstance(leaf, jax.Array)
    ):
        damaged, unchecked = _every_process_finding(findings, where)
    if damaged:
        raise CorruptCheckpointError(
            f"Cannot read the checkpoint at {where}: the bytes read for these leaves differ from "
            "those saved (their checksums, written with the step, do not match), so its files were "
            f"damaged or changed after the save:{bullet_list(damaged)}\nRestore another step, or "
            "restore with verify=False to get the damaged values anyway."
        )
    if unchecked:
        warnings.warn(
            f"Restoring the checkpoint at {where}: these parts of leaves, saved whole by one process "
            f"with {sums.described}, are restored split over processes, so no process "
            f"holds one whole to check it against its checksum, and they restore unchecked: {unchecked}. "
            "Restore onto a sharding that keeps each leaf within one process to check them, or save "
            "the step again with this version.",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )


# How long a process waits for the others to finish checking what they restored.
_FINDINGS_TIMEOUT_S = 300


def _every_process_finding(findings: verification.Findings, where: str) -> tuple[list[str], list[str]]:
    """What every process of the job found, so that all of them raise, or warn, together: the
    damaged regions each found alone, those split between processes, checked from every
    process's partial checksums, and the regions left unchecked.

    Where the restored arrays are sharded over the processes, each process checks the regions it
    holds, and only the one holding a damaged region would find it: it would raise while the
    others went on into a step and waited in its collectives for it, until JAX's heartbeat ended
    the job with an error about a lost process instead of the checkpoint.
    """
    mine = json.dumps(
        {"damaged": findings.damaged, "partial": findings.partial, "unchecked": findings.unchecked}
    )
    found = coordination.every_process_value(mine, caller=f"restoring {where}", timeout_s=_FINDINGS_TIMEOUT_S)
    every_damaged: list[str] = []
    every_unchecked: list[str] = []
    partial = {}
    for process, text in sorted(found.items()):
        finding = json.loads(text)
        every_damaged += [f"{line} (found by process {process})" for line in finding["damaged"]]
        every_unchecked += [part for part in finding["unchecked"] if part not in every_unchecked]
        partial[process] = {where: tuple(sums) for where, sums in finding["partial"].items()}
    return every_damaged + verification.combine(partial), every_unchecked


def _abstract_target(
    target: PyTree,
    saved: dict[str, tuple[tuple[int, ...], np.dtype]],
    prng_impls: dict[str, str],
    where: str,
    placement: Placement,
) -> PyTree:
    """An abstract tree shaped like `target`, each leaf as stored (PRNG keys as their data) with
    its sharding by `placement`; every difference from the `saved` leaves is one error.
    """
    problems = []
    wanted = {}
    unusable: set[str] = set()
    for path, leaf in jax.tree_util.tree_flatten_with_path(target)[0]:
        name = stored_leaves.path_string(path)
        if isinstance(leaf, PYTHON_SCALARS):
            leaf = jnp.asarray(leaf)
        if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
            problems.append(
                f"{name}: the target leaf is a {type(leaf).__name__}, not an array or ShapeDtypeStruct"
            )
            unusable.add(name)  # Reported once, not again as missing from the target.
            continue
        shape, dtype = tuple(leaf.shape), leaf.dtype
        if jnp.issubdtype(dtype, jax.dtypes.prng_key):
            if name not in prng_impls:
                problems.append(
                    f"{name}: the target holds PRNG keys, the checkpoint plain {_shown(saved.get(name))}"
                )
                continue
            data = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(shape, dtype))
            shape, dtype = tuple(data.shape), data.dtype
        wanted[name] = (shape, np.dtype(dtype))
    for name in sorted(wanted.keys() - saved.keys()):
        problems.append(f"{name}: in the target, not in the checkpoint")
    for name in sorted(saved.keys() - wanted.keys() - unusable):
        problems.append(f"{name}: in the checkpoint ({_shown(saved[name])}), not in the target")
    for name in sorted(wanted.keys() & saved.keys()):
        if wanted[name] != saved[name]:
            problems.append(
                f"{name}: the checkpoint has {_shown(saved[name])}, the target {_shown(wanted[name])}"
            )
    if problems:
        listed = problems[:_MAX_LISTED]
        more = f"\n  ... and {len(problems) - _MAX_LISTED} more" if len(problems) > _MAX_LISTED else ""
        raise CheckpointMismatchError(
            f"The target does not match the checkpoint at {where}; nothing was restored:"
            f"{bullet_list(listed)}{more}"
        )

    placed = placement.shardings(target)

    def abstract_leaf(path: tuple[Any, ...], leaf: Any) -> jax.ShapeDtypeStruct:
        name = stored_leaves.path_string(path)
        shape, dtype = wanted[name]
        return jax.ShapeDtypeStruct(shape, dtype, sharding=placed[name])

    return jax.tree_util.tree_map_with_path(abstract_leaf, target)


def _as_restored(
    saved: PyTree, saved_leaves: dict[str, tuple[tuple[int, ...], np.dtype]], prng_impls: dict[str, str]
) -> PyTree:
    """The `saved` leaves as `jax.ShapeDtypeStruct`s of what restoring gives back: zero-size arrays
    with their shapes (`saved_leaves` has them), PRNG keys as keys, so that they are laid out as
    `put` would lay out the restored leaves."""

    def restored(path: tuple[Any, ...], meta: Any) -> jax.ShapeDtypeStruct:
        name = stored_leaves.path_string(path)
        data = jax.ShapeDtypeStruct(*saved_leaves[name])
        impl = prng_impls.get(name)
        if impl is None:
            return data
        return jax.eval_shape(functools.partial(jax.random.wrap_key_data, impl=impl), data)

    return jax.tree_util.tree_map_with_path(restored, saved)


def _shown(shape_and_dtype: tuple[tuple[int, ...], np.dtype] | None) -> str:
    """A leaf's shape and dtype as messages show them, `float32[3, 4]`; `nothing` for none."""
    if shape_and_dtype is None:
        return "nothing"
    shape, dtype = shape_and_dtype
    return f"{dtype.name}{list(shape)}"
