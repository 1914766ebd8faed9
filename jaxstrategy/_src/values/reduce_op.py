"""`ReduceOp` and the pure reductions behind `Strategy.reduce` and `ReplicaContext.all_reduce`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.arguments import CaseInsensitiveEnum, as_index, is_int
from jaxstrategy._src.core.errors import bullet_list, format_path
from jaxstrategy._src.core.tree_checks import require_array_leaves
from jaxstrategy._src.core.types import PyTree


class ReduceOp(CaseInsensitiveEnum):
    """How values from different replicas (or along an axis) are combined.

    `SUM` adds; `MEAN` divides the global sum by the global count, so replicas holding different
    numbers of examples are weighted correctly. Strings name the members in any case: `'sum'`,
    `'Mean'`. Unlike TensorFlow, `ReduceOp('sum')` itself accepts the lower-case string too.

    Example:
      >>> import jaxstrategy
      >>> jaxstrategy.ReduceOp('mean')
      <ReduceOp.MEAN: 'MEAN'>
    """

    SUM = "SUM"
    MEAN = "MEAN"


def as_reduce_op(op: Any, *, caller: str) -> ReduceOp:
    """Return `op` as a `ReduceOp`, accepting the member or its name in any case.

    Raises:
      ValueError: `op` is a string that names no `ReduceOp`.
      TypeError: `op` is neither a string nor a `ReduceOp`.
    """
    if isinstance(op, ReduceOp):
        return op
    expected = "ReduceOp.SUM, ReduceOp.MEAN, or the string 'sum' or 'mean' (any case)"
    if isinstance(op, str):
        try:
            return ReduceOp(op)
        except ValueError:
            raise ValueError(f"{caller}: {op!r} is not a valid ReduceOp; expected {expected}.") from None
    raise TypeError(f"{caller}: reduce_op must be {expected}; got {op!r} of type {type(op).__name__}.")


def normalize_axis(axis: Any, ndim: int, *, caller: str, where: str = "the value") -> tuple[int, ...]:
    """Return `axis` (an int or a sequence of ints, negative counting from the end) as a sorted
    tuple of non-negative axes of an array of rank `ndim`.

    Raises:
      TypeError: `axis` is not an int or a sequence of ints.
      ValueError: an axis is out of range for rank `ndim`, or repeated.
    """
    axes = tuple(axis) if isinstance(axis, tuple | list) else (axis,)
    try:
        axes = tuple(as_index(a) for a in axes)
    except TypeError:
        raise TypeError(f"{caller}: axis must be an int, a tuple of ints, or None; got {axis!r}.") from None
    if ndim == 0:
        raise ValueError(
            f"{caller}: {where} is a scalar (rank 0), so it has no axis {axis!r}. Pass axis=None, "
            "or give the value a leading batch dimension."
        )
    if any(not -ndim <= a < ndim for a in axes):
        raise ValueError(
            f"{caller}: axis {axis!r} is out of range for {where}, which has rank {ndim}; "
            f"expected an axis in [{-ndim}, {ndim})."
        )
    normalized = tuple(sorted(a % ndim for a in axes))
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"{caller}: axis {axis!r} repeats an axis.")
    return normalized


def axes_of_leaves(
    tree: PyTree, axis: Any, *, caller: str, single: bool = False, why: str = ""
) -> list[tuple[int, ...]]:
    """Check `axis` against every leaf of `tree`; return each leaf's normalized axes.

    Args:
      tree: a pytree of array-likes.
      axis: an int, or (unless `single`) a sequence of ints.
      caller: the call to name in messages.
      single: require one int axis, as gathering does.
      why: appended to the message for leaves that are not arrays.

    Raises:
      TypeError: a leaf is not an array, or `axis` has the wrong type; every bad leaf is named.
      ValueError: `axis` does not fit some leaves; every such leaf is named, in one message.
    """
    require_array_leaves(tree, caller=caller, why=why)
    if single and not is_int(axis, numpy=True):
        raise TypeError(f"{caller}: axis must be an int; got {axis!r}.")
    axes, misfits = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        where = f"the leaf at {format_path('value', path)}" if path else "the value"
        try:
            axes.append(normalize_axis(axis, np.ndim(leaf), caller=caller, where=where))
        except ValueError as err:
            misfits.append(str(err).removeprefix(f"{caller}: "))
    if len(misfits) == 1:
        raise ValueError(f"{caller}: {misfits[0]}")
    if misfits:
        raise ValueError(f"{caller}: axis {axis!r} does not fit these leaves:{bullet_list(misfits)}")
    return axes


def mean_dtype(dtype: Any) -> np.dtype:
    """The dtype `jnp.mean` returns for inputs of `dtype`: floats keep theirs, the rest get JAX's
    default float (float32 unless x64 is on)."""
    if jnp.issubdtype(dtype, jnp.inexact):
        return np.dtype(dtype)
    return np.dtype(jax.dtypes.canonicalize_dtype(np.float64))


def reduce_tree(op: ReduceOp, tree: PyTree, axis: Any, *, caller: str) -> PyTree:
    """Reduce every leaf of `tree` along `axis` with `op`, as one replica's part of a reduction.

    Leaves must be array-likes; all of them are checked before any is reduced, and every bad
    leaf is reported at once (TypeError for a leaf that is not an array, ValueError for an axis
    out of range). The result of MEAN on integers is JAX's default float.

    Example:
      >>> import jax.numpy as jnp
      >>> caller = 'MirroredStrategy.reduce()'
      >>> mean = reduce_tree(ReduceOp.MEAN, {'x': jnp.arange(4)}, 0, caller=caller)
      >>> mean['x'].tolist()
      1.5
    """
    axes = axes_of_leaves(tree, axis, caller=caller, why=" to reduce along an axis")
    leaves, treedef = jax.tree.flatten(tree)
    reduce = jnp.sum if op is ReduceOp.SUM else jnp.mean
    reduced = [
        reduce(jnp.asarray(leaf), axis=leaf_axes) for leaf, leaf_axes in zip(leaves, axes, strict=True)
    ]
    return jax.tree.unflatten(treedef, reduced)
