"""A PerReplica used as one value: every such use is the library's error, saying what to do."""

from __future__ import annotations

import re

import numpy as np
import pytest

import jaxstrategy


@pytest.fixture
def per_replica_loss(cpu_devices):
    strategy = jaxstrategy.MirroredStrategy(cpu_devices[:2])
    # A loss not all-reduced: the first mistake of many a port to several devices.
    return strategy.run(lambda: jaxstrategy.get_replica_context().replica_id_in_sync_group.astype("float32"))


@pytest.mark.parametrize(
    ("use", "said"),
    [
        (float, "turned into one float"),
        (int, "turned into one int"),
        (bool, "used as one truth value"),
        (np.asarray, "used as one array"),
    ],
    ids=["float", "int", "bool", "numpy"],
)
def test_a_per_replica_used_as_one_value_says_how_to_combine_it(per_replica_loss, use, said):
    assert isinstance(per_replica_loss, jaxstrategy.PerReplica)
    with pytest.raises(
        TypeError,
        match=re.escape(f"A PerReplica holds one value per replica, so it cannot be {said}. Take its")
        + r".*strategy\.reduce\(\.\.\.\).*all-reduce the value inside run",
    ):
        use(per_replica_loss)


def test_shape_dtype_and_ndim_are_one_replicas_part(cpu_devices):
    # Issue 28, item 6: code that inspects a batch or an element_spec on one device runs on many.
    import jax.numpy as jnp

    strategy = jaxstrategy.MirroredStrategy(cpu_devices[:4])
    dataset = strategy.experimental_distribute_dataset([{"x": np.ones((32, 5), np.float32)}])
    batch = next(iter(dataset))
    assert (batch["x"].shape, batch["x"].dtype, batch["x"].ndim) == ((8, 5), jnp.float32, 2)
    spec = dataset.element_spec["x"]
    assert (spec.shape, spec.dtype) == ((8, 5), jnp.float32)
    sharded = jaxstrategy.ShardedStrategy(cpu_devices[:4], num_replicas=2)
    assert next(iter(sharded.experimental_distribute_dataset([np.ones((32, 5))]))).shape == (16, 5)
