"""jaxstrategy: TensorFlow's `tf.distribute.Strategy` API, done the JAX way.

A strategy holds devices; `run` compiles a step function once and computes on them; variables
are pytrees committed to them. Code written against `OneDeviceStrategy` is meant to run unchanged
when the constructor changes to a strategy over more devices.
"""

import os as _os

from jaxstrategy._src.cluster.resolver import ClusterResolver as ClusterResolver
from jaxstrategy._src.cluster.resolver import SimpleClusterResolver as SimpleClusterResolver
from jaxstrategy._src.cluster.resolver import TFConfigClusterResolver as TFConfigClusterResolver
from jaxstrategy._src.core.errors import InvalidDeviceError as InvalidDeviceError
from jaxstrategy._src.core.errors import JaxStrategyError as JaxStrategyError
from jaxstrategy._src.core.errors import StrategyContextError as StrategyContextError
from jaxstrategy._src.core.jax_compat import hide_frames_under as _hide_frames_under
from jaxstrategy._src.input.datasets import DistributedDataset as DistributedDataset
from jaxstrategy._src.input.datasets import DistributedIterator as DistributedIterator
from jaxstrategy._src.input.datasets import OptionalBatch as OptionalBatch
from jaxstrategy._src.input.datasets import OutOfRangeError as OutOfRangeError
from jaxstrategy._src.strategies.job import StrategyExtended as StrategyExtended
from jaxstrategy._src.strategies.mirrored import MirroredStrategy as MirroredStrategy
from jaxstrategy._src.strategies.multi_worker import (
    MultiWorkerMirroredStrategy as MultiWorkerMirroredStrategy,
)
from jaxstrategy._src.strategies.multi_worker_sharded import (
    MultiWorkerShardedStrategy as MultiWorkerShardedStrategy,
)
from jaxstrategy._src.strategies.one_device import OneDeviceStrategy as OneDeviceStrategy
from jaxstrategy._src.strategies.sharded import ShardedStrategy as ShardedStrategy
from jaxstrategy._src.strategies.sharded import with_sharding_constraint as with_sharding_constraint
from jaxstrategy._src.strategies.strategy import Strategy as Strategy
from jaxstrategy._src.strategies.strategy import experimental_set_strategy as experimental_set_strategy
from jaxstrategy._src.strategies.strategy import get_replica_context as get_replica_context
from jaxstrategy._src.strategies.strategy import get_strategy as get_strategy
from jaxstrategy._src.values.contexts import InputContext as InputContext
from jaxstrategy._src.values.contexts import ReplicaContext as ReplicaContext
from jaxstrategy._src.values.contexts import ValueContext as ValueContext
from jaxstrategy._src.values.contexts import has_strategy as has_strategy
from jaxstrategy._src.values.contexts import in_cross_replica_context as in_cross_replica_context
from jaxstrategy._src.values.options import InputOptions as InputOptions
from jaxstrategy._src.values.options import InputReplicationMode as InputReplicationMode
from jaxstrategy._src.values.options import RunOptions as RunOptions
from jaxstrategy._src.values.per_replica import PerReplica as PerReplica
from jaxstrategy._src.values.reduce_op import ReduceOp as ReduceOp

__version__ = "0.2.0"

# An error in a user's step points at the user's code, not at the frames of run's wrappers.
_hide_frames_under(_os.path.dirname(__file__))

# Submodules load on first use: orbax alone takes seconds to import.
_LAZY_SUBMODULES = ("checkpoint", "nn", "testing")


def __getattr__(name: str) -> object:
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f"jaxstrategy.{name}")
    raise AttributeError(f"module 'jaxstrategy' has no attribute {name!r}")


__all__ = (
    "ClusterResolver",
    "DistributedDataset",
    "DistributedIterator",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "InvalidDeviceError",
    "JaxStrategyError",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "MultiWorkerShardedStrategy",
    "OneDeviceStrategy",
    "OptionalBatch",
    "OutOfRangeError",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "RunOptions",
    "ShardedStrategy",
    "SimpleClusterResolver",
    "Strategy",
    "StrategyExtended",
    "StrategyContextError",
    "TFConfigClusterResolver",
    "ValueContext",
    "experimental_set_strategy",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "with_sharding_constraint",
)
