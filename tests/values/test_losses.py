"""jaxstrategy.nn: TensorFlow's `tf.nn.compute_average_loss` and `scale_regularization_loss`.

The expected values are worked out by hand from TensorFlow's definitions (the weighted sum of
the per-example losses over the global batch, 0 for an empty one; a regularization sum over the
number of replicas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import MirroredStrategy, OneDeviceStrategy, StrategyContextError
from jaxstrategy.nn import compute_average_loss, scale_regularization_loss

LOSSES = np.array([1.0, 2.0, 3.0], np.float32)


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({}, 2.0),
        ({"global_batch_size": 4}, 1.5),
        ({"global_batch_size": np.int64(12)}, 0.5),
        ({"sample_weight": np.array([1.0, 0.0, 2.0])}, 7.0 / 3),
        ({"sample_weight": 0.5, "global_batch_size": 2}, 1.5),
        ({"global_batch_size": 0}, 0.0),
    ],
)
def test_compute_average_loss_outside_every_scope_is_one_replica(kwargs, expected):
    loss = compute_average_loss(LOSSES, **kwargs)
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)


def test_one_weight_per_example_weighs_every_loss_of_that_example():
    # TensorFlow lines the weights up with the batch axis, whatever the losses' rank.
    per_token = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)
    assert (
        float(compute_average_loss(per_token, sample_weight=np.array([1.0, 0.0]), global_batch_size=2)) == 1.5
    )
    assert (
        float(compute_average_loss(per_token, sample_weight=np.array([[1.0], [0.0]]), global_batch_size=2))
        == 1.5
    )
    assert (
        float(compute_average_loss(per_token, sample_weight=np.array([[1.0, 0.0]]), global_batch_size=2))
        == 2.0
    )
    assert float(
        compute_average_loss(LOSSES, sample_weight=np.array([[1.0], [0.0], [1.0]]))
    ) == pytest.approx(4 / 3)
    with pytest.raises(ValueError, match=r"sample_weight of shape \(4,\)") as err:
        compute_average_loss(np.ones((3, 4), np.float32), sample_weight=np.ones(4))
    assert "per_example_loss of shape (3, 4)" in str(err.value)


def test_the_default_global_batch_is_the_replica_batch_times_the_replicas(cpu_devices):
    strategy = MirroredStrategy(cpu_devices[:4])
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: jnp.full((3, 2), context.replica_id_in_sync_group + 1.0)
    )

    def step(losses):
        loss = compute_average_loss(losses)
        return loss, jaxstrategy.get_replica_context().all_reduce("sum", loss)

    each, total = strategy.run(step, args=(per_replica,))
    # Replica r sums 6 * (r + 1) over a global batch of 3 * 4 examples.
    assert [float(v) for v in strategy.experimental_local_results(each)] == [0.5, 1.0, 1.5, 2.0]
    assert float(total) == 5.0
    one = OneDeviceStrategy().run(lambda losses: compute_average_loss(losses), args=(LOSSES,))
    assert float(one) == 2.0


def test_a_traced_global_batch_size_counts_the_real_examples_of_a_padded_batch(cpu_devices):
    strategy = MirroredStrategy(cpu_devices[:4])
    options = jaxstrategy.InputOptions(partial_batch="pad")
    ((losses, mask),) = strategy.experimental_distribute_dataset(
        [np.arange(1.0, 6.0, dtype=np.float32)], options
    )

    def step(losses, mask):
        context = jaxstrategy.get_replica_context()
        examples = context.all_reduce("sum", jnp.sum(mask, dtype=jnp.int32))
        loss = compute_average_loss(losses, sample_weight=mask, global_batch_size=examples)
        return context.all_reduce("sum", loss)

    assert float(strategy.run(step, args=(losses, mask))) == 3.0  # (1 + 2 + 3 + 4 + 5) / 5


def test_scale_regularization_loss_divides_by_the_replicas(cpu_devices):
    assert float(scale_regularization_loss(jnp.array([1.0, 3.0]))) == 4.0
    strategy = MirroredStrategy(cpu_devices[:4])
    assert float(strategy.run(lambda: scale_regularization_loss(jnp.array([1.0, 3.0])))) == 1.0


@pytest.mark.parametrize(
    "losses, kwargs, error, message",
    [
        (np.float32(1.0), {}, ValueError, r"per_example_loss must have rank 1 or more.*got a scalar"),
        (np.array([1, 2]), {}, TypeError, r"per_example_loss must be floating point; got int"),
        (LOSSES, {"global_batch_size": 3.0}, TypeError, r"global_batch_size must be an integer.*got 3.0"),
        (LOSSES, {"global_batch_size": True}, TypeError, r"global_batch_size must be an integer.*got True"),
        (LOSSES, {"global_batch_size": -1}, ValueError, r"global_batch_size must be non-negative; got -1"),
        (LOSSES, {"global_batch_size": np.array([3])}, ValueError, r"must be a scalar; got shape \(1,\)"),
    ],
)
def test_compute_average_loss_errors(losses, kwargs, error, message):
    with pytest.raises(error, match=message):
        compute_average_loss(losses, **kwargs)


def test_the_optional_arguments_are_keyword_only():
    # TensorFlow's second positional argument is sample_weight; a batch size there would weight.
    with pytest.raises(TypeError, match="positional argument"):
        compute_average_loss(LOSSES, 8)  # type: ignore[misc]


def test_in_the_cross_replica_context_there_is_no_replica_batch():
    with OneDeviceStrategy().scope():
        with pytest.raises(
            StrategyContextError, match=r"compute_average_loss\(\) was called in the cross"
        ) as err:
            compute_average_loss(LOSSES)
        assert "pass global_batch_size" in str(err.value)
        assert float(compute_average_loss(LOSSES, global_batch_size=6)) == 1.0
        with pytest.raises(
            StrategyContextError, match=r"scale_regularization_loss\(\) was called in the"
        ) as err:
            scale_regularization_loss(1.0)
        assert "call it inside Strategy.run" in str(err.value)


@pytest.mark.parametrize(
    "global_batch_size, message",
    [
        (np.int64(2**32 + 2), r"global_batch_size is int64 with the value 4294967298, outside int32's"),
        (np.int64(2**31), r"global_batch_size is int64 with the value 2147483648, outside int32's"),
        (np.uint64(2**32 + 2), r"global_batch_size is uint64 with the value 4294967298, outside uint32's"),
        (2**31, r"global_batch_size is the Python int 2147483648, outside int32's"),
    ],
    ids=["int64-wraps-to-2", "int64-wraps-negative", "uint64", "python-int"],
)
def test_a_global_batch_size_that_32_bits_would_change_is_refused(global_batch_size, message):
    # docs/semantics.md, row "a global_batch_size past int32's range" (TensorFlow 2.21 uses it as
    # it is). With jax_enable_x64 off, np.int64(2**32 + 2) became the int32 2, and the loss 3.
    with pytest.raises(
        OverflowError, match=r"^jaxstrategy\.nn\.compute_average_loss\(\): .*\n  " + message
    ) as err:
        compute_average_loss(LOSSES, global_batch_size=global_batch_size)
    assert "jax_enable_x64" in str(err.value)


def test_with_64_bit_types_a_wide_global_batch_size_is_used_as_it_is():
    with jax.enable_x64(True):
        loss = compute_average_loss(LOSSES, global_batch_size=np.int64(2**32 + 2))
    assert loss.dtype == np.float32
    np.testing.assert_allclose(float(loss), 6 / (2**32 + 2), rtol=1e-6)


def _numpy_average_loss(losses, weights, global_batch_size):
    """TensorFlow's definition, computed in float32 and cast back to the losses' dtype."""
    total = np.sum(losses.astype(np.float32) * (1 if weights is None else weights.astype(np.float32)))
    return (total / np.float32(global_batch_size)).astype(losses.dtype)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize(
    "loss, weight, global_batch_size",
    [
        (1.5, None, 70_000),  # float16 holds at most 65504: the divisor was inf, the loss 0.
        (1.5, None, 2**20),
        (30_000.0, None, 4),  # The sum, 120000, overflowed float16 to inf.
        # Each weighted loss, 90000, would overflow float16; with strict dtype promotion (as in
        # this suite) any weight on a half-precision loss was a TypePromotionError.
        (300.0, 300.0, 8),
    ],
    ids=["batch-70000", "batch-2**20", "sum-overflows", "weighted"],
)
def test_half_precision_losses_are_averaged_in_float32(dtype, loss, weight, global_batch_size):
    # docs/semantics.md, row "float16 losses over a global batch past 65504": TensorFlow 2.21
    # gives 0.0 for the first case and inf for the third.
    losses = np.full(4, loss, dtype)
    weights = None if weight is None else np.full(4, weight, dtype)
    average = compute_average_loss(losses, sample_weight=weights, global_batch_size=global_batch_size)
    expected = _numpy_average_loss(losses, weights, global_batch_size)
    assert average.dtype == dtype and np.isfinite(expected) and expected != 0
    assert float(average) == float(expected)


@pytest.mark.parametrize("jit", [False, True], ids=["run", "run-in-jit"])
def test_a_negative_global_batch_size_computed_in_run_gives_nan(cpu_devices, jit):
    # docs/semantics.md, row "a negative global_batch_size computed inside run": TensorFlow
    # asserts at run time; a compiled program cannot raise here (see losses.py's docstring), and
    # a negative divisor would turn the loss, and training, around.
    strategy = MirroredStrategy(cpu_devices[:2])

    def step(losses, examples):
        def loss_fn(losses):
            return compute_average_loss(losses, global_batch_size=examples - 10)

        return jax.value_and_grad(loss_fn)(losses)

    def call(examples):
        return strategy.run(step, args=(LOSSES, examples))

    for examples, expected, expected_grad in [(4, np.nan, np.nan), (16, 1.0, 1 / 6)]:
        loss, grad = (jax.jit(call) if jit else call)(examples)
        np.testing.assert_equal(float(loss), expected)
        # nan gradients too, not zeros that would leave the parameters quietly where they were.
        np.testing.assert_allclose(np.asarray(grad), np.full(3, expected_grad, np.float32), rtol=1e-6)
