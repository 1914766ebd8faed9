"""How checkpoint leaves are stored by orbax, and read back as jax arrays on a strategy.

Typed PRNG keys are stored as their raw data, and arrays with no elements (which orbax cannot
store) as a scalar placeholder of their dtype; JSON maps by path keep what makes them again.
Leaves JAX would narrow while `jax_enable_x64` is off are read exactly onto the host, since orbax
casts silently as it reads. Paths are strings independent of container types, since orbax saves
tuples and nodes as dicts and lists.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.errors import bullet_list, caller_stacklevel
from jaxstrategy._src.core.tree_checks import PYTHON_SCALARS
from jaxstrategy._src.core.types import PyTree


def is_prng_key(leaf: Any) -> bool:
    return hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def split_prng_keys(tree: PyTree) -> tuple[PyTree, dict[str, str]]:
    """Replace typed PRNG keys by their raw data and Python numbers by arrays; map key paths to impls."""
    impls = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_prng_key(leaf):
            impls[path_string(path)] = str(jax.random.key_impl(leaf))
    state = jax.tree.map(_savable, tree)
    return state, impls


def _savable(leaf: Any) -> Any:
    if is_prng_key(leaf):
        leaf = jax.random.key_data(leaf)
    elif isinstance(leaf, PYTHON_SCALARS):
        # As JAX would type it (int32, float32), so a target of jnp.asarray(...) or the same
        # Python number matches; orbax alone would save a Python int as int64.
        leaf = jnp.asarray(leaf)
    if jax.process_count() > 1 and isinstance(leaf, jax.Array) and leaf.is_fully_addressable:
        # An array of this process alone (made outside the strategy) in a job of several: orbax
        # saves only arrays over every process, or host arrays, which the chief writes. Every
        # process holds the same value, as they run the same program.
        return np.asarray(leaf)
    return leaf


def replace_zero_size(state: PyTree) -> tuple[PyTree, dict[str, list[int]]]:
    """Replace arrays with no elements, which orbax cannot store, by scalars; map paths to shapes."""
    shapes = {}

    def replace(path: tuple[Any, ...], leaf: Any) -> Any:
        if leaf.size:
            return leaf
        shapes[path_string(path)] = list(leaf.shape)
        return np.zeros((), leaf.dtype)

    state = jax.tree_util.tree_map_with_path(replace, state)
    return state, shapes


def path_string(path: tuple[Any, ...]) -> str:
    """A path in a form independent of container types: orbax saves tuples and nodes as dicts/lists."""
    return "/".join(path_parts(path))


def path_parts(path: tuple[Any, ...]) -> list[str]:
    """The keys of `path` as strings, as orbax names them."""
    parts = []
    for entry in path:
        for attribute in ("key", "idx", "name"):
            if hasattr(entry, attribute):
                parts.append(str(getattr(entry, attribute)))
                break
        else:
            parts.append(str(entry))
    return parts


def as_stored(
    abstract: PyTree, zero_size: dict[str, tuple[int, ...]], replicated: jax.sharding.Sharding
) -> PyTree:
    """Ask orbax for the scalar placeholder stored in place of each zero-size array, onto
    `replicated` (a scalar has no dimension to split, whatever layout its leaf has)."""
    if not zero_size:
        return abstract

    def stored(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        if path_string(path) not in zero_size:
            return leaf
        return jax.ShapeDtypeStruct((), leaf.dtype, sharding=replicated)

    return jax.tree_util.tree_map_with_path(stored, abstract)


def restore_zero_size(
    tree: PyTree, zero_size: dict[str, tuple[int, ...]], shardings: dict[str, jax.sharding.Sharding]
) -> PyTree:
    """Put back the zero-size arrays, each committed to its sharding in `shardings` (by path), as
    orbax places the others."""
    if not zero_size:
        return tree

    def restore(path: tuple[Any, ...], leaf: Any) -> Any:
        name = path_string(path)
        shape = zero_size.get(name)
        if shape is None:
            return leaf
        empty = np.zeros(shape, leaf.dtype)
        return jax.make_array_from_callback(shape, shardings[name], lambda index: empty[index])

    return jax.tree_util.tree_map_with_path(restore, tree)


def _is_narrowed(dtype: Any) -> bool:
    """Whether JAX holds `dtype` narrower (int64 as int32): so while `jax_enable_x64` is off."""
    return np.dtype(dtype) != np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def wide_on_host(abstract: PyTree) -> PyTree:
    """Ask orbax for each leaf JAX would narrow as an exact numpy array instead.

    Orbax casts to the requested dtype as it reads, and asked for the int32 that JAX makes of an
    int64 it wraps silently (2**40 + 5 comes back as 5); read exactly, the values are checked
    before they are narrowed.
    """

    def on_host(leaf: jax.ShapeDtypeStruct) -> Any:
        if not _is_narrowed(leaf.dtype):
            return leaf
        # A broadcast view allocates nothing; orbax reads only its shape and dtype.
        return np.broadcast_to(np.zeros((), leaf.dtype), leaf.shape)

    return jax.tree.map(on_host, abstract)


def narrow_wide(tree: PyTree, shardings: dict[str, jax.sharding.Sharding], where: str) -> PyTree:
    """Narrow the leaves `wide_on_host` read as numpy to JAX's dtypes, each onto its sharding in
    `shardings` (by path).

    Integers that do not fit are an OverflowError; floats lose precision with a warning.
    """
    wide = [(path, leaf) for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0] if _is_host(leaf)]
    overflowing, rounded = [], []
    for path, leaf in wide:
        narrow = np.dtype(jax.dtypes.canonicalize_dtype(leaf.dtype))
        if np.issubdtype(narrow, np.integer):
            info = np.iinfo(narrow)
            if leaf.size and (leaf.min() < info.min or leaf.max() > info.max):
                overflowing.append(
                    f"{path_string(path)}: {leaf.dtype.name} values from {leaf.min()} to {leaf.max()}, "
                    f"beyond {narrow.name}"
                )
        else:
            rounded.append(f"{path_string(path)} ({leaf.dtype.name} as {narrow.name})")
    if overflowing:
        raise OverflowError(
            f"Cannot restore the checkpoint at {where}: leaves hold values too large for the 32-bit "
            f"integers JAX uses while `jax_enable_x64` is off:{bullet_list(overflowing)}\nTurn on "
            "64-bit mode, jax.config.update('jax_enable_x64', True), before restoring."
        )
    if rounded:
        warnings.warn(
            f"Restoring the checkpoint at {where}: {rounded} come back with less precision, as JAX "
            "holds them while `jax_enable_x64` is off. Turn on 64-bit mode, "
            "jax.config.update('jax_enable_x64', True), before restoring to keep them exact.",
            UserWarning,
            stacklevel=caller_stacklevel(),
        )

    def place(path: tuple[Any, ...], leaf: Any) -> Any:
        if not _is_host(leaf):
            return leaf
        narrowed = leaf.astype(jax.dtypes.canonicalize_dtype(leaf.dtype))
        sharding = shardings[path_string(path)]
        return jax.make_array_from_callback(leaf.shape, sharding, lambda index: narrowed[index])

    return jax.tree_util.tree_map_with_path(place, tree)


def _is_host(leaf: Any) -> bool:
    # Orbax returns numpy arrays only where `wide_on_host` asked for them.
    return isinstance(leaf, np.ndarray)


def wrap_prng_keys(tree: PyTree, prng_impls: dict[str, str]) -> PyTree:
    if not prng_impls:
        return tree

    def wrap(path: tuple[Any, ...], leaf: Any) -> Any:
        impl = prng_impls.get(path_string(path))
        return leaf if impl is None else jax.random.wrap_key_data(leaf, impl=impl)

    return jax.tree_util.tree_map_with_path(wrap, tree)
