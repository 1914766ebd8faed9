"""jaxstrategy.nn: TensorFlow's `tf.nn.compute_average_loss` and `scale_regularization_loss`.

The expected values are worked out by hand from TensorFlow's definitions (the weighted sum of
the per-example losses over the global batch, 0 for an empty one; a regularization sum over the
number of replicas).
"""

from __future__ import annotations

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
    with pytest.raises(
        ValueError, match=r"sample_weight of shape \(4,\) does not fit per_example_loss of shape \(3, 4\)"
    ):
        compute_average_loss(np.ones((3, 4), np.float32), sample_weight=np.ones(4))


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
            StrategyContextError,
            match=r"compute_average_loss\(\) was called in the cross-replica context.*pass global_batch_size",
        ):
            compute_average_loss(LOSSES)
        assert float(compute_average_loss(LOSSES, global_batch_size=6)) == 1.0
        with pytest.raises(
            StrategyContextError,
            match=r"scale_regularization_loss\(\) was called in the cross-replica context.*inside Strategy.run",
        ):
            scale_regularization_loss(1.0)
