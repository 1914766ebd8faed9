"""The public names are a contract: any addition or removal must show up as a diff here."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest

import jaxstrategy

PUBLIC_NAMES = (
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

STRATEGY_METHODS = (
    "cluster_resolver",
    "device",
    "devices",
    "distribute_datasets_from_function",
    "experimental_distribute_dataset",
    "experimental_distribute_datasets_from_function",
    "experimental_distribute_values_from_function",
    "experimental_local_results",
    "extended",
    "gather",
    "init",
    "mesh",
    "num_replicas_in_sync",
    "put",
    "reduce",
    "run",
    "scope",
    "sharding",
)


CHECKPOINT_NAMES = (
    "CheckpointLockedError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "Checkpointer",
    "CorruptCheckpointError",
    "PREEMPTED_EXIT_CODE",
    "PreemptionHandler",
    "restore",
    "save",
)


def test_checkpoint_module_is_pinned():
    from jaxstrategy import checkpoint

    assert checkpoint.__all__ == CHECKPOINT_NAMES
    for name in CHECKPOINT_NAMES:
        assert getattr(checkpoint, name).__doc__, name
    for name in ("Checkpointer", "save", "restore", "PreemptionHandler"):
        assert ">>>" in getattr(checkpoint, name).__doc__, name
    assert checkpoint.PREEMPTED_EXIT_CODE == 42
    assert [name for name in dir(checkpoint.PreemptionHandler) if not name.startswith("_")] == [
        "close",
        "preempted",
        "restore",
        "step",
        "steps",
    ]


def test_distributed_iterators_save_and_restore_their_position():
    iterator = jaxstrategy.DistributedIterator
    assert ">>>" in iterator.get_state.__doc__
    assert set(inspect.signature(iterator.set_state).parameters) == {"self", "state"}


def test_testing_module_is_pinned():
    from jaxstrategy import testing

    assert testing.__all__ == ("assert_tree_on_strategy", "force_cpu_devices", "run_local_workers")
    assert all(">>>" in getattr(testing, name).__doc__ for name in testing.__all__)
    assert jaxstrategy.testing is testing


def test_nn_module_is_pinned():
    from jaxstrategy import nn

    assert nn.__all__ == ("compute_average_loss", "scale_regularization_loss")
    assert all(">>>" in getattr(nn, name).__doc__ for name in nn.__all__)
    assert jaxstrategy.nn is nn


def test_tensorflow_loss_scaling_names_are_kept():
    def parameters(function):
        return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]

    assert parameters(jaxstrategy.nn.compute_average_loss) == [
        ("per_example_loss", inspect.Parameter.empty),
        ("sample_weight", None),
        ("global_batch_size", None),
    ]
    assert parameters(jaxstrategy.nn.scale_regularization_loss) == [
        ("regularization_loss", inspect.Parameter.empty)
    ]


@pytest.mark.slow  # A fresh process.
def test_importing_jaxstrategy_does_not_import_orbax():
    import subprocess
    import sys

    code = "import sys, jaxstrategy; print('orbax.checkpoint' in sys.modules)"
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        == "False\n"
    )


def test_all_is_pinned():
    assert jaxstrategy.__all__ == PUBLIC_NAMES
    assert all(hasattr(jaxstrategy, name) for name in PUBLIC_NAMES)


def test_strategy_surface_is_pinned():
    public = tuple(sorted(name for name in dir(jaxstrategy.OneDeviceStrategy) if not name.startswith("_")))
    assert public == STRATEGY_METHODS
    mirrored = tuple(sorted(name for name in dir(jaxstrategy.MirroredStrategy) if not name.startswith("_")))
    # The same surface but `device`: several devices have no single one (nor in TensorFlow).
    assert mirrored == tuple(name for name in STRATEGY_METHODS if name != "device")
    multi_worker = jaxstrategy.MultiWorkerMirroredStrategy
    assert tuple(sorted(name for name in dir(multi_worker) if not name.startswith("_"))) == mirrored
    for resolver in (jaxstrategy.SimpleClusterResolver, jaxstrategy.TFConfigClusterResolver):
        assert issubclass(resolver, jaxstrategy.ClusterResolver)
    sharded = tuple(sorted(name for name in dir(jaxstrategy.ShardedStrategy) if not name.startswith("_")))
    added = ("describe_layout", "devices_per_replica", "layout_of", "model_parallel")
    assert sharded == tuple(sorted(mirrored + added))
    multi_worker_sharded = jaxstrategy.MultiWorkerShardedStrategy
    assert tuple(sorted(name for name in dir(multi_worker_sharded) if not name.startswith("_"))) == sharded
    public_of_per_replica = [name for name in dir(jaxstrategy.PerReplica) if not name.startswith("_")]
    assert public_of_per_replica == ["dtype", "ndim", "shape", "stacked", "values"]


def test_tensorflow_signatures_are_kept():
    def parameters(function):
        return [(p.name, p.default) for p in inspect.signature(function).parameters.values()]

    empty = inspect.Parameter.empty
    strategy = jaxstrategy.OneDeviceStrategy
    assert parameters(strategy.run) == [
        ("self", empty),
        ("fn", empty),
        ("args", ()),
        ("kwargs", None),
        ("options", None),
    ]
    assert parameters(strategy.reduce) == [
        ("self", empty),
        ("reduce_op", empty),
        ("value", empty),
        ("axis", empty),
    ]
    assert parameters(strategy.gather) == [("self", empty), ("value", empty), ("axis", empty)]
    assert parameters(strategy) == [("device", None), ("soft_placement", False)]
    assert parameters(jaxstrategy.MirroredStrategy) == [("devices", None), ("cross_device_ops", None)]
    # TensorFlow's one argument, then JAX's start-up timeouts and the input's (keyword-only).
    assert parameters(jaxstrategy.MultiWorkerMirroredStrategy) == [
        ("cluster_resolver", None),
        ("initialization_timeout", 300),
        ("heartbeat_timeout_seconds", 100),
        ("input_timeout_seconds", 3600),
    ]


def test_every_public_name_has_a_docstring_with_an_example():
    for name in PUBLIC_NAMES:
        obj = getattr(jaxstrategy, name)
        if inspect.isclass(obj) and issubclass(obj, Exception):
            assert obj.__doc__, name
            continue
        if name == "Strategy":
            continue  # Abstract; documented through OneDeviceStrategy.
        assert obj.__doc__ and ">>>" in obj.__doc__, f"{name} has no doctest example"
    for cls in (
        jaxstrategy.OneDeviceStrategy,
        jaxstrategy.MirroredStrategy,
        jaxstrategy.MultiWorkerMirroredStrategy,
    ):
        for method in STRATEGY_METHODS:
            if method == "device" and cls is not jaxstrategy.OneDeviceStrategy:
                continue
            member = inspect.getattr_static(cls, method)
            assert getattr(member, "__doc__", None), f"{cls.__name__}.{method} has no docstring"
    for method in (
        "run",
        "reduce",
        "gather",
        "scope",
        "put",
        "init",
        "experimental_local_results",
        "experimental_distribute_dataset",
        "distribute_datasets_from_function",
        "experimental_distribute_values_from_function",
    ):
        assert ">>>" in getattr(jaxstrategy.OneDeviceStrategy, method).__doc__, method


@pytest.mark.slow  # A fresh process.
def test_importing_the_package_does_not_start_jax():
    # A JAX that has started cannot join a job of several processes, and MultiWorkerMirroredStrategy
    # must be creatable after `import jaxstrategy`: importing creates no array and asks for no device.
    # `backends_started` answers False when it finds nothing to ask, so the program first checks
    # that it found JAX's own check, and last that it answers True once JAX has started.
    program = (
        "import jaxstrategy, jaxstrategy.checkpoint, jaxstrategy.nn, jaxstrategy.testing\n"
        "from jaxstrategy._src.core import jax_compat\n"
        "assert jax_compat._backends_are_initialized is not None, 'jax_compat found no backends check'\n"
        "assert not jax_compat.backends_started(), 'importing jaxstrategy started JAX'\n"
        "import jax\n"
        "jax.devices()\n"
        "assert jax_compat.backends_started(), 'backends_started() misses a started JAX'\n"
    )
    completed = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, check=False)
    assert completed.returncode == 0, completed.stderr
