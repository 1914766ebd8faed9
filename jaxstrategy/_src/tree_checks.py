"""Checks on the leaves of pytrees: which are arrays, and errors that name every bad one."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.errors import bullet_list, format_path
from jaxstrategy._src.types import PyTree

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
