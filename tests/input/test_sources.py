"""Input sources read as host elements: passes, elements, cardinality (through the public API in
test_datasets.py; here the functions themselves)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxstrategy._src.input.sources import (
    INFINITE_CARDINALITY,
    UNKNOWN_CARDINALITY,
    cardinality_of,
    grouped_cardinality,
    host_elements,
    host_passes,
    is_in_memory,
)


class _TfLike:
    """What `tf.data.Dataset` offers that the sources use."""

    def as_numpy_iterator(self):
        return iter([np.zeros(2), np.ones(2)])

    def cardinality(self):
        return INFINITE_CARDINALITY


def test_a_list_starts_a_new_pass_each_time():
    start, one_shot = host_passes([1, 2], caller="f()")
    assert not one_shot
    assert list(start()) == list(start()) == [1, 2]


def test_a_generator_is_one_shot():
    start, one_shot = host_passes((x for x in range(2)), caller="f()")
    assert one_shot
    assert list(start()) == [0, 1] and list(start()) == []


def test_a_tf_data_like_source_is_read_through_as_numpy_iterator():
    start, one_shot = host_passes(_TfLike(), caller="f()")
    assert not one_shot
    assert [x.tolist() for x in start()] == [[0.0, 0.0], [1.0, 1.0]]


def test_a_mapping_or_a_non_iterable_is_an_error():
    with pytest.raises(TypeError, match=r"^f\(\): the dataset is a dict, whose iteration"):
        host_passes({"x": np.zeros(2)}, caller="f()")
    with pytest.raises(TypeError, match=r"^f\(\): the dataset must be an iterable .*; got int\.$"):
        host_passes(3, caller="f()")


def test_in_memory_sources():
    assert all(is_in_memory(s) for s in ([], (), np.zeros(2)))
    assert not is_in_memory(x for x in ())


def test_host_elements_are_private_numpy_copies():
    buffer = np.zeros(2)
    (element,) = host_elements(iter([{"x": buffer, "n": 3}]), keep_jax_arrays=True)
    buffer[:] = 1
    n, x = element.leaves  # In key order.
    assert x.tolist() == [0.0, 0.0] and n.tolist() == 3
    assert all(isinstance(leaf, np.ndarray) for leaf in element.leaves)


@pytest.mark.parametrize("keep_jax_arrays", [True, False])
def test_host_elements_keep_jax_arrays_only_when_asked(keep_jax_arrays):
    array = jax.numpy.arange(3)
    (element,) = host_elements(iter([array]), keep_jax_arrays=keep_jax_arrays)
    (leaf,) = element.leaves
    if keep_jax_arrays:
        assert leaf is array
    else:
        assert isinstance(leaf, np.ndarray) and leaf.tolist() == [0, 1, 2]


def test_host_elements_name_every_leaf_that_is_not_an_array():
    with pytest.raises(TypeError, match=r"(?s)batch\['a'\] is a str.*batch\['c'\] is a object"):
        list(host_elements(iter([{"a": "text", "b": np.zeros(1), "c": object()}]), keep_jax_arrays=True))


def test_cardinality_of():
    assert cardinality_of([1, 2, 3]) == 3
    assert cardinality_of(_TfLike()) == INFINITE_CARDINALITY
    assert cardinality_of(x for x in ()) == UNKNOWN_CARDINALITY


@pytest.mark.parametrize(
    "cardinalities, num_replicas, grouping, partial_batch, expected",
    [
        ([5], 2, "split", "error", 5),
        ([5], 2, "consecutive", "pad", 3),
        ([4], 2, "consecutive", "error", 2),
        ([3, 5], 2, "zip", "pad", 4),
        ([3, 3], 2, "zip", "pad", 3),
        ([5], 2, "split", "drop", UNKNOWN_CARDINALITY),
        ([5], 1, "split", "drop", 5),
        ([INFINITE_CARDINALITY], 2, "consecutive", "error", INFINITE_CARDINALITY),
        ([INFINITE_CARDINALITY, 3], 2, "zip", "error", UNKNOWN_CARDINALITY),
    ],
    ids=[
        "split",
        "consecutive-rest",
        "consecutive-whole",
        "zip-uneven",
        "zip-even",
        "drop-unknown",
        "drop-one-replica",
        "infinite",
        "mixed",
    ],
)
def test_grouped_cardinality(cardinalities, num_replicas, grouping, partial_batch, expected):
    assert grouped_cardinality(cardinalities, num_replicas, grouping, partial_batch) == expected
