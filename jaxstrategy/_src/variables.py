"""Variables: pytrees of arrays committed to a strategy's sharding."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jaxstrategy._src.tree_checks import is_array_like, require_array_leaves
from jaxstrategy._src.types import PyTree


def place_tree(
    tree: PyTree, sharding: jax.sharding.Sharding, *, caller: str, static_ok: bool = False
) -> PyTree:
    """Return `tree` with every array-like leaf committed to `sharding`, in one transfer.

    On CPU, `jax.device_put` of a numpy array may share the array's memory (measured: every time
    for 64-byte-aligned arrays), so a later write to the numpy array would change the variable.
    Numpy leaves bound for a CPU device are therefore copied first.

    Args:
      tree: a pytree of array-likes.
      sharding: where to commit the arrays.
      caller: the call to name in messages.
      static_ok: leave non-array leaves as they are instead of raising.

    Raises:
      TypeError: a leaf is not an array-like and `static_ok` is False; every such leaf is named.

    Example:
      >>> import jax, numpy as np
      >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      >>> placed = place_tree({'w': np.ones(2)}, sharding, caller='put()')
      >>> placed['w'].committed
      True
    """
    if not static_ok:
        require_array_leaves(tree, caller=caller, name="tree")
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if is_array_like(leaf)]
    on_cpu = all(device.platform == "cpu" for device in sharding.device_set)  # type: ignore[attr-defined]
    arrays = [_unaliased(leaves[i]) if on_cpu else leaves[i] for i in positions]
    for i, placed in zip(positions, jax.device_put(arrays, sharding), strict=True):
        leaves[i] = placed
    return jax.tree.unflatten(treedef, leaves)


def _unaliased(leaf: Any) -> Any:
    return leaf.copy() if isinstance(leaf, np.ndarray) else leaf
