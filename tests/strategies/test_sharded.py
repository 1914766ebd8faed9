"""ShardedStrategy: the shared conformance suite on (replicas, devices per replica) = (1, 4),
(2, 2) and (4, 1), training against a plain `jax.jit` loop on one device, and the layout rules."""

from __future__ import annotations

import pytest
from conformance import StrategyConformance

from jaxstrategy import ShardedStrategy

SHAPES = [(1, 4), (2, 2), (4, 1)]

# The conformance suite's variables are small: split from 64 bytes up, so that its leaves are
# laid out over the shards too. Its odd-sized ones cannot be, and say so.
pytestmark = pytest.mark.filterwarnings("ignore:.*no dimension of it divides:UserWarning")


@pytest.fixture(params=SHAPES, ids=lambda shape: f"R{shape[0]}xS{shape[1]}")
def sharded_on_every_shape(request, cpu_devices):
    replicas, _ = request.param
    return ShardedStrategy(cpu_devices[:4], num_replicas=replicas, min_shard_bytes=64)


class TestConformance(StrategyConformance):
    @pytest.fixture
    def strategy_under_test(self, sharded_on_every_shape):
        return sharded_on_every_shape
