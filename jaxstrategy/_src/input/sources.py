"""A user's input source, read as host elements: passes over it, its elements, its length.

A source is anything iterable that yields batches: a list or tuple, a numpy array (its rows), a
generator (one pass only), a `tf.data.Dataset` (through `as_numpy_iterator`), a torch
`DataLoader`, a Grain loader, or any object with `__iter__` or `__getitem__`. None of those
libraries is imported: each is recognised by what it has. `host_passes` starts passes over a
source, `host_elements` turns what a pass yields into private numpy copies, and `cardinality_of`
reads how many elements it will yield, where the source knows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import jax
import numpy as np

from jaxstrategy._src.core.errors import bullet_list, format_path
from jaxstrategy._src.core.tree_checks import is_array_like, is_wide_host_leaf, require_representable
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.input.replica_batches import Grouping, HostElement
from jaxstrategy._src.values.variables import private_copy

# tf.data's constants for a length that is infinite, or not known before reading.
INFINITE_CARDINALITY = -1
UNKNOWN_CARDINALITY = -2
# Sources whose elements are already in host memory: reading one is a copy, CPU work.
_IN_MEMORY = (list, tuple, np.ndarray)


def host_passes(dataset: Any, *, caller: str) -> tuple[Callable[[], Iterator[Any]], bool]:
    """Return a function that starts a new pass over `dataset`, and whether it is one-shot.

    Raises:
      TypeError: `dataset` is not iterable.
    """
    as_numpy = getattr(dataset, "as_numpy_iterator", None)
    if callable(as_numpy):  # tf.data.Dataset: its elements as numpy, without importing TensorFlow.
        return as_numpy, False
    if isinstance(dataset, Mapping):
        raise TypeError(
            f"{caller}: the dataset is a {type(dataset).__name__}, whose iteration yields its keys. "
            "Pass a list of batches (each batch may be a dict), or a generator of them; to slice "
            "arrays into batches, e.g. [{k: v[i:i + n] for k, v in d.items()} for i in range(0, len, n)]."
        )
    if isinstance(dataset, Iterator):  # A generator object or another one-shot iterator.
        return (lambda: dataset), True
    if isinstance(dataset, Iterable) or hasattr(dataset, "__getitem__"):
        return (lambda: iter(dataset)), False
    raise TypeError(
        f"{caller}: the dataset must be an iterable of batches (a list, a generator, a tf.data "
        f"Dataset, a torch DataLoader, ...); got {type(dataset).__name__}."
    )


def is_in_memory(dataset: Any) -> bool:
    """Whether `dataset`'s elements are already in host memory (a list, tuple or numpy array)."""
    return isinstance(dataset, _IN_MEMORY)


def host_elements(source: Iterator[Any], *, keep_jax_arrays: bool) -> Iterator[HostElement]:
    """The elements of `source` as array leaves: numpy arrays, each copied once, and with
    `keep_jax_arrays` jax arrays as they are.

    Leaves become numpy arrays first (anything with `__array__` or `.numpy()`: torch and
    TensorFlow tensors included). Each is copied (see `variables.private_copy`), so a source that
    refills one buffer for every batch cannot change batches already delivered. Jax arrays cannot
    change, and may already be on the strategy's device, where they are used as they are: no
    copy, and on an accelerator no round trip through host memory. Batches split over replicas
    take jax arrays as numpy instead: the split is free on the host, where on a device each leaf
    would be one more program a step.

    Raises:
      TypeError: a leaf cannot be an array; every such leaf is named by its path.
      OverflowError: a leaf's values do not fit JAX's 32-bit types (x64 off); each is named.
    """
    for element in source:
        leaves, treedef = jax.tree.flatten(element)
        host = [_to_host_array(leaf) for leaf in leaves]
        bad = [i for i, leaf in enumerate(host) if leaf is None]
        if bad:
            raise TypeError(_describe_bad_leaves(element, bad))
        # Only 64-bit numpy leaves and Python ints can hold what 32 bits cannot.
        if any(type(leaf) is int or is_wide_host_leaf(leaf) for leaf in host):
            # Raised at the step this element belongs to, as any error of the source.
            require_representable(
                jax.tree.unflatten(treedef, host), caller="the distributed dataset", name="element"
            )
        yield HostElement([_private_array(leaf, keep_jax_arrays) for leaf in host], treedef)


def _private_array(leaf: Any, keep_jax_arrays: bool) -> Any:
    if keep_jax_arrays and isinstance(leaf, jax.Array):
        return leaf
    return np.asarray(private_copy(leaf))


def _to_host_array(leaf: Any) -> Any:
    """The leaf as an array JAX accepts, or None when it cannot be one."""
    if is_array_like(leaf):
        return leaf
    if hasattr(leaf, "__array__"):
        array = np.asarray(leaf)
    elif callable(getattr(leaf, "numpy", None)):
        array = np.asarray(leaf.numpy())
    else:
        return None
    return array if is_array_like(array) else None


def _describe_bad_leaves(element: PyTree, positions: list[int]) -> str:
    paths = jax.tree_util.tree_flatten_with_path(element)[0]
    lines = [f"{format_path('batch', paths[i][0])} is a {type(paths[i][1]).__name__}" for i in positions]
    return (
        "Every leaf of a dataset element must be a numeric array (numpy, jax, or anything with "
        f"__array__ or .numpy()), but:{bullet_list(lines)}\nDrop those fields before distributing the "
        "dataset, or encode them as numbers."
    )


def cardinality_of(dataset: Any) -> int:
    """The number of elements `dataset` will yield, or TensorFlow's INFINITE/UNKNOWN constants."""
    tf_cardinality = getattr(dataset, "cardinality", None)
    if callable(tf_cardinality):
        return int(tf_cardinality())
    try:
        return len(dataset)
    except TypeError:
        return UNKNOWN_CARDINALITY


def grouped_cardinality(
    cardinalities: list[int], num_replicas: int, grouping: Grouping, partial_batch: str
) -> int:
    """The number of batches made from sources of these cardinalities, where it is known.

    `num_replicas` is the number of replicas the sources feed: this process's, with `consecutive`.
    `partial_batch` is `InputOptions.partial_batch`.
    """
    if any(c < 0 for c in cardinalities):
        infinite = all(c == INFINITE_CARDINALITY for c in cardinalities)
        return INFINITE_CARDINALITY if infinite else UNKNOWN_CARDINALITY
    if partial_batch == "drop" and num_replicas > 1:
        # Which batches are dropped depends on their sizes, which are not known before reading.
        return UNKNOWN_CARDINALITY
    if grouping == "split":
        return cardinalities[0]
    if grouping == "zip":
        shortest, longest = min(cardinalities), max(cardinalities)
        return shortest + (longest > shortest)
    whole, rest = divmod(cardinalities[0], num_replicas)
    return whole + (rest > 0)
