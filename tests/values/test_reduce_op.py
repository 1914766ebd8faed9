"""ReduceOp and the pure reductions, including property tests against numpy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from jaxstrategy import ReduceOp
from jaxstrategy._src.values.reduce_op import as_reduce_op, mean_dtype, normalize_axis, reduce_tree


@pytest.mark.parametrize(
    ("name", "op"), [("sum", ReduceOp.SUM), ("SUM", ReduceOp.SUM), ("Mean", ReduceOp.MEAN)]
)
def test_names_in_any_case(name, op):
    assert ReduceOp(name) is op
    assert as_reduce_op(name, caller="test") is op


def test_unknown_name():
    with pytest.raises(
        ValueError, match=r"^test: 'max' is not a valid ReduceOp; expected ReduceOp.SUM, ReduceOp.MEAN"
    ):
        as_reduce_op("max", caller="test")


def test_wrong_type():
    with pytest.raises(TypeError, match=r"^test: reduce_op must be .*; got None of type NoneType\.$"):
        as_reduce_op(None, caller="test")


@pytest.mark.parametrize(
    ("axis", "ndim", "expected"),
    [(0, 1, (0,)), (-1, 3, (2,)), ((0, -1), 3, (0, 2)), ([1], 2, (1,)), (np.int64(1), 2, (1,))],
)
def test_normalize_axis(axis, ndim, expected):
    assert normalize_axis(axis, ndim, caller="test") == expected


@pytest.mark.parametrize(
    ("axis", "error", "message"),
    [
        (1.0, TypeError, r"axis must be an int, a tuple of ints, or None; got 1.0"),
        (True, TypeError, r"axis must be an int, a tuple of ints, or None; got True"),
        ((0, 0), ValueError, r"axis \(0, 0\) repeats an axis"),
        (
            2,
            ValueError,
            r"axis 2 is out of range for the value, which has rank 2; expected an axis in \[-2, 2\)",
        ),
    ],
)
def test_normalize_axis_errors(axis, error, message):
    with pytest.raises(error, match=message):
        normalize_axis(axis, 2, caller="test")


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        (jnp.int32, jnp.float32),
        (jnp.bool_, jnp.float32),
        (jnp.float16, jnp.float16),
        (jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_mean_dtype_follows_jnp_mean(dtype, expected):
    assert mean_dtype(dtype) == expected == jnp.mean(jnp.zeros(2, dtype)).dtype


def test_empty_arrays():
    assert reduce_tree(ReduceOp.SUM, jnp.zeros((0,)), 0, caller="t").tolist() == 0.0
    assert np.isnan(reduce_tree(ReduceOp.MEAN, jnp.zeros((0,)), 0, caller="t").tolist())


_DTYPES = st.sampled_from([np.float32, np.int32, np.int8, np.uint8, np.bool_])


@st.composite
def _arrays_and_axes(draw):
    dtype = draw(_DTYPES)
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=4, min_side=1, max_side=5))
    if dtype == np.float32:
        elements = st.floats(-100, 100, width=32)
    elif dtype == np.bool_:
        elements = st.booleans()
    else:
        info = np.iinfo(dtype)
        # Small enough that a sum cannot overflow the dtype JAX accumulates in.
        elements = st.integers(max(info.min, -10), min(info.max, 10))
    array = draw(hnp.arrays(dtype, shape, elements=elements))
    ndim = len(shape)
    axes = draw(
        st.lists(st.integers(-ndim, ndim - 1), min_size=1, max_size=ndim, unique_by=lambda a: a % ndim)
    )
    axis = axes[0] if len(axes) == 1 and draw(st.booleans()) else tuple(axes)
    return array, axis


@pytest.mark.slow  # 11-13 s, each example compiles: over the fast tier's bound (docs/development.md).
@settings(max_examples=60, deadline=None)
@given(_arrays_and_axes(), st.sampled_from([ReduceOp.SUM, ReduceOp.MEAN]))
def test_reduce_matches_numpy(array_and_axis, op):
    array, axis = array_and_axis
    result = reduce_tree(op, {"x": array}, axis, caller="test")["x"]
    expected = np.sum(array, axis=axis) if op is ReduceOp.SUM else np.mean(array, axis=axis)
    np.testing.assert_allclose(np.asarray(result, np.float64), expected, rtol=1e-5, atol=1e-4)
    if op is ReduceOp.MEAN:
        assert result.dtype == mean_dtype(array.dtype)
    assert result.shape == np.shape(expected)
