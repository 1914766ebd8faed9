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
