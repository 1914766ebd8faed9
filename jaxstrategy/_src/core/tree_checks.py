"""Checks on the leaves of pytrees: which are arrays, and errors that name every bad one."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.errors import bullet_list, format_path
from jaxstrategy._src.core.jax_compat import ARRAY_TYPE
from jaxstrategy._src.core.types import PyTree

# The Python scalars JAX traces as weakly typed arrays.
PYTHON_SCALARS = (bool, int, float, complex)
# JAX arrays (tracers included) and those scalars.
_TRACED_TYPES = (jax.Array, *PYTHON_SCALARS)


def is_array_like(x: Any) -> bool:
    """Whether `x` is a value JAX traces: a JAX or numeric numpy array or scalar, or a Python number.

    Everything else (strings, enums, configs, functions) is a static, compile-time value. An
    `IntEnum` member is an int, and `jax.jit` traces it like one; use a plain `Enum` for a static
    choice of code path.
    """
    if isinstance(x, _TRACED_TYPES):
        return True
    if isinstance(x, np.ndarray | np.generic):
        # jnp.issubdtype, unlike numpy's, knows the ml_dtypes types such as bfloat16.
        return x.dtype == np.bool_ or jnp.issubdtype(x.dtype, jnp.number)
    return hasattr(x, "__jax_array__")


def require_array_leaves(tree: PyTree, *, caller: str, name: str = "value", why: str = "") -> None:
    """Raise a TypeError that names, by path, every leaf of `tree` that is not array-like."""
    bad = [
        f"{format_path(name, path)} is a {type(leaf).__name__}"
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if not is_array_like(leaf)
    ]
    if bad:
        raise TypeError(f"{caller}: every leaf must be an array{why}:{bullet_list(bad)}")


_INT32 = np.iinfo(np.int32)
_UINT32 = np.iinfo(np.uint32)
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def require_representable(
    tree: PyTree, *, caller: str, name: str = "value", is_leaf: Callable[[Any], bool] | None = None
) -> None:
    """Raise an OverflowError that names every leaf whose values JAX would silently change.

    With `jax_enable_x64` off (JAX's default), JAX stores 64-bit numbers in 32 bits: integers
    outside int32's (uint32's) range wrap around, and finite floats beyond float32's range become
    inf. Only host values are checked, JAX arrays being 32-bit already; Python ints and floats
    are checked too (JAX traces them as 32-bit), so that the error names the leaf. Subtrees
    `is_leaf` picks are not looked into.
    """
    if _x64_enabled() or not any(map(_may_be_unrepresentable, jax.tree.leaves(tree, is_leaf=is_leaf))):
        return  # Spares the paths, dear to build: run's checked path asks this of every call.
    flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]
    require_named_representable([(format_path(name, path), leaf) for path, leaf in flat], caller=caller)


def require_named_representable(named: list[tuple[str, Any]], *, caller: str) -> None:
    """`require_representable` of values each given with the name the error calls it by.

    Example:
      >>> try:
      ...     require_named_representable([('n', np.int64(2**40))], caller='run()')
      ... except OverflowError as error:
      ...     print(str(error).splitlines()[1])
        n is int64 with the value 1099511627776, outside int32's -2147483648 to 2147483647
    """
    if _x64_enabled():
        return
    bad = [f"{label} {problem}" for label, leaf in named if (problem := _unrepresentable(leaf))]
    if bad:
        raise OverflowError(
            f"{caller}: these values do not fit the 32-bit types JAX uses while jax_enable_x64 is "
            f"off, and would change silently:{bullet_list(bad)}\nCast them to a type that holds them, "
            "or turn 64-bit types on with jax.config.update('jax_enable_x64', True) before using JAX."
        )


def _x64_enabled() -> bool:
    return bool(jax.dtypes.canonicalize_dtype(np.int64) == np.int64)


# Leaf types that never hold a value `require_representable` refuses: Python ints and bools (JAX
# checks a Python int's range itself), by exact type since numpy's scalar types subclass them,
# and JAX's concrete array type, seeded here and joined by any other `jax.Array` subclass that
# `has_wide_host_leaf` meets (tracers are not `jax.Array` subclasses: they take its slower look).
# A set of types lets `run`'s hot path ask its question at C speed, with no Python call per leaf.
# It only ever grows (atomically, under the GIL). Python floats are not in it: one beyond
# float32's range would become inf.
NARROW_LEAF_TYPES: set[type] = {bool, int, complex, *([] if ARRAY_TYPE is None else [ARRAY_TYPE])}


def has_wide_host_leaf(tree: PyTree) -> bool:
    """Whether `tree` holds a leaf `require_representable` may refuse: a 64-bit numpy integer or
    float (array, of any ndarray subclass, or scalar), or a Python float beyond float32's range.

    Cheap enough for `run`'s hot path, which sends trees holding one to the checked path: every
    step is done in C (flattening, the leaves' types, the numpy arrays' dtypes), and Python looks
    only at each distinct type and dtype.

    Example:
      >>> has_wide_host_leaf({'w': jnp.ones(3), 'step': 1, 'rate': 0.5})
      False
      >>> has_wide_host_leaf([np.arange(3, dtype=np.int64)])
      True
    """
    leaves = jax.tree.leaves(tree)
    kinds = set(map(type, leaves))
    if kinds <= NARROW_LEAF_TYPES:
        return False
    arrays: set[type] = set()
    for kind in kinds - NARROW_LEAF_TYPES:
        if issubclass(kind, np.ndarray):
            arrays.add(kind)
        elif issubclass(kind, np.generic):
            if _is_wide(np.dtype(kind)):
                return True
        elif kind is float:
            floats = itertools.compress(leaves, map(operator.is_, map(type, leaves), itertools.repeat(float)))
            # Beyond float32's range, or inf (which the checked path lets through); nan is not.
            if any(map(_FLOAT32_MAX.__lt__, map(abs, floats))):
                return True
        elif issubclass(kind, jax.Array):  # So that the next tree with a leaf of this type is quicker.
            NARROW_LEAF_TYPES.add(kind)
    if not arrays:
        return False
    in_arrays = map(arrays.__contains__, map(type, leaves))
    return any(_is_wide(dtype) for dtype in set(map(_DTYPE_OF, itertools.compress(leaves, in_arrays))))


_DTYPE_OF = operator.attrgetter("dtype")


def _is_wide(dtype: np.dtype[Any]) -> bool:
    return dtype.itemsize == 8 and dtype.kind in "iuf"


def is_wide_host_leaf(leaf: Any) -> bool:
    """Whether `leaf` is a 64-bit numpy integer or float (array or scalar)."""
    return isinstance(leaf, np.ndarray | np.generic) and _is_wide(leaf.dtype)


def _may_be_unrepresentable(leaf: Any) -> bool:
    """A cheap pre-check of `_unrepresentable`: False for the leaves it never objects to."""
    if type(leaf) is float:
        return abs(leaf) > _FLOAT32_MAX
    return isinstance(leaf, int | np.ndarray | np.generic) and not isinstance(leaf, bool)


def _unrepresentable(leaf: Any) -> str | None:
    """What JAX would change in `leaf` with 32-bit types, or None."""
    if isinstance(leaf, bool) or not isinstance(leaf, int | float | np.ndarray | np.generic):
        return None
    if isinstance(leaf, int):  # Traced as a weakly typed int32.
        if _INT32.min <= leaf <= _INT32.max:
            return None
        return f"is the Python int {leaf}, outside int32's {_INT32.min} to {_INT32.max}"
    if type(leaf) is float:  # Traced as a weakly typed float32.
        if not abs(leaf) > _FLOAT32_MAX or leaf in (math.inf, -math.inf):
            return None
        return f"is the Python float {leaf:g}, beyond float32's range (it would be inf)"
    if not isinstance(leaf, np.ndarray | np.generic):  # Another subclass of float: left to JAX.
        return None
    if leaf.dtype.itemsize != 8 or leaf.dtype.kind not in "iuf" or leaf.size == 0:
        return None
    if leaf.dtype.kind == "f":
        floats = np.asarray(leaf)
        finite = np.abs(floats[np.isfinite(floats)])
        if finite.size == 0 or finite.max() <= _FLOAT32_MAX:
            return None
        return f"is float64 with the finite value {finite.max():g}, beyond float32's range (it would be inf)"
    limits = _UINT32 if leaf.dtype.kind == "u" else _INT32
    low, high = int(leaf.min()), int(leaf.max())
    if limits.min <= low and high <= limits.max:
        return None
    values = f"the value {low}" if low == high else f"values from {low} to {high}"
    return f"is {leaf.dtype} with {values}, outside {limits.dtype}'s {limits.min} to {limits.max}"
