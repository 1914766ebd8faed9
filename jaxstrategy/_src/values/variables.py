"""Variables: pytrees of arrays committed to a strategy's sharding."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.tree_checks import is_array_like, require_array_leaves, require_representable
from jaxstrategy._src.core.types import PyTree


def place_tree(
    tree: PyTree,
    sharding: jax.sharding.Sharding | PyTree,
    *,
    caller: str,
    static_ok: bool = False,
    own_buffers: bool = False,
) -> PyTree:
    """Return `tree` with every array-like leaf committed to `sharding`, in one transfer.

    Numpy leaves are copied first (see `private_copy`), so a later write to the numpy array
    cannot change the variable. With `own_buffers`, no placed array shares a device buffer with a
    jax array of `tree`, nor with another placed array (see `_owning_their_buffers`): what `put`
    promises, so that donating a variable never deletes another one.

    Args:
      tree: a pytree of array-likes.
      sharding: where to commit the arrays: one sharding, or a tree of them shaped like `tree`.
      caller: the call to name in messages.
      static_ok: leave non-array leaves as they are instead of raising.
      own_buffers: copy, on its devices, each placed array that would share a buffer.

    Raises:
      TypeError: a leaf is not an array-like and `static_ok` is False; every such leaf is named.
      OverflowError: a leaf's values do not fit JAX's 32-bit types (x64 off); each is named.

    Example:
      >>> import jax, numpy as np
      >>> sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
      >>> placed = place_tree({'w': np.ones(2)}, sharding, caller='put()')
      >>> placed['w'].committed
      True
    """
    if not static_ok:
        require_array_leaves(tree, caller=caller, name="tree")
    require_representable(tree, caller=caller, name="tree")
    leaves, treedef = jax.tree.flatten(tree)
    positions = [i for i, leaf in enumerate(leaves) if is_array_like(leaf)]
    arrays = [private_copy(leaves[i]) for i in positions]
    if not isinstance(sharding, jax.sharding.Sharding):
        leaf_shardings = jax.tree.leaves(sharding)
        sharding = [leaf_shardings[i] for i in positions]
    placed = put_private(arrays, sharding)
    if own_buffers:
        placed = _owning_their_buffers(arrays, placed)
    for i, array in zip(positions, placed, strict=True):
        leaves[i] = array
    return jax.tree.unflatten(treedef, leaves)


def device_buffers(array: jax.Array) -> set[tuple[int, int]]:
    """The device buffers behind this process's shards of `array`: (device id, address) pairs.

    Two arrays share memory exactly when these sets meet. Addresses alone would not do: two
    accelerators can hand out the same address. A deleted array, a tracer, and an array with no
    elements (which owns no memory, and whose address may be null for every such array) have none.
    """
    if is_tracer(array) or array.is_deleted() or array.size == 0:
        return set()
    return {(shard.device.id, shard.data.unsafe_buffer_pointer()) for shard in array.addressable_shards}


def _owning_their_buffers(sources: list[Any], placed: list[Any]) -> list[Any]:
    """`placed`, with a copy of each array that shares a device buffer with a jax array in `sources`.

    `jax.device_put` returns an array that is already where it should be as a new array over the
    same buffer, and onto several devices it keeps the shard already on one of them, even with
    `may_alias=False` (measured on JAX 0.10.2). Two variables put from one array would then share
    a buffer, and donating one of them in `run` deletes the other: XLA refuses that on one device
    and crashes the process (a segfault) on several. All sharing starts from the sources' buffers,
    since `device_put` never makes two fresh copies share one.
    """
    held: set[tuple[int, int]] = set()
    for source in sources:
        if isinstance(source, jax.Array):
            held |= device_buffers(source)
    if not held:
        return placed
    return [
        jnp.copy(array)
        if isinstance(array, jax.Array) and not held.isdisjoint(device_buffers(array))
        else array
        for array in placed
    ]


def private_copy(leaf: Any) -> Any:
    """`leaf`, or a copy of it that nobody else can write: what is safe to hand to `device_put`.

    On CPU, `jax.device_put` of a numpy array may share its memory (measured: every time for
    64-byte-aligned arrays, `may_alias=False` notwithstanding), and on accelerators the transfer
    may still be reading it after the call returns. Either way a later write to the array would
    change what was placed, and even a read-only array may be a view of memory that is written
    elsewhere. Numpy arrays are therefore copied; jax arrays and Python numbers cannot change.
    """
    return leaf.copy() if isinstance(leaf, np.ndarray) else leaf


def put_private(leaves: list[Any], sharding: jax.sharding.Sharding | list[Any]) -> list[Any]:
    """`device_put_anywhere` of leaves that went through `private_copy`.

    Nothing else can write them, so JAX may use their memory as it is (`may_alias=True`): on CPU
    that skips a second copy (docs/performance.md, "The input pipeline", says what it saves).
    """
    return device_put_anywhere(leaves, sharding, may_alias=True)


def device_put_anywhere(
    leaves: list[Any], sharding: jax.sharding.Sharding | list[Any], *, may_alias: bool | None = None
) -> list[Any]:
    """`jax.device_put(leaves, sharding)`, also of this process's arrays onto a mesh of several.

    JAX refuses to move an array committed to this process's devices onto devices of other
    processes. Every process holds the same value (they run the same program), so each builds
    its own devices' parts from its copy instead, as `jit` does with such an argument.
    """
    shardings = [sharding] * len(leaves) if isinstance(sharding, jax.sharding.Sharding) else sharding
    if all(s.is_fully_addressable for s in shardings):
        return jax.device_put(leaves, sharding, may_alias=may_alias)
    return [
        _parts_from_this_process(leaf, where)
        if isinstance(leaf, jax.Array)
        and not is_tracer(leaf)  # Under an outer jit: a sharding constraint.
        and leaf.is_fully_addressable
        and not where.is_fully_addressable
        else jax.device_put(leaf, where, may_alias=may_alias)
        for leaf, where in zip(leaves, shardings, strict=True)
    ]


def _parts_from_this_process(array: jax.Array, sharding: jax.sharding.Sharding) -> jax.Array:
    return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])
