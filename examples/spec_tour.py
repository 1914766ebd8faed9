"""A tour of TensorFlow's `tf.distribute.OneDeviceStrategy` doc page, in jaxstrategy form.

Each function below runs one example of that page (the spec) with `jaxstrategy.OneDeviceStrategy`
and prints its result under a heading naming the example: construction and
`extended.worker_devices`, the device forms of the constructor's Args, `scope()` with a variable
created inside, the `step_fn` loop that prints 90, `reduce`, `experimental_local_results`,
`gather`, `experimental_distribute_values_from_function`, the `cluster_resolver` and
`num_replicas_in_sync` attributes, and the replica context inside `run`.

The dataset examples run with a numpy array and a list in place of `tf.data` (any iterable of
batches works, a `tf.data.Dataset` included). The spec shows `gather` and
`experimental_distribute_values_from_function` with MirroredStrategy, which jaxstrategy does not
have yet; their OneDeviceStrategy equivalents run here instead (one replica, so local results are
1-tuples and `gather` returns its input unchanged).

Run it with `make demo`, or `python examples/spec_tour.py --device /cpu:0` (on a machine with a
GPU, `--device /gpu:0`). A device this process does not have is an error (exit status 2), where
TensorFlow would silently compute on another device.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxstrategy


def heading(title: str) -> None:
    print(f"\n== {title} ==")


def where(array: jax.Array) -> str:
    """The device(s) an array lives on, as JAX names them ('cpu:0'), and whether it is committed."""
    devices = ", ".join(sorted(str(device) for device in array.devices()))
    return f"on {devices}, committed={array.committed}"


def local_values(strategy: jaxstrategy.OneDeviceStrategy, value: Any) -> tuple[Any, ...]:
    """`experimental_local_results(value)` with each array as a plain Python value."""
    return tuple(np.asarray(local).tolist() for local in strategy.experimental_local_results(value))


def show_construction(device: str) -> jaxstrategy.OneDeviceStrategy:
    """strategy = tf.distribute.OneDeviceStrategy(device="/gpu:0")."""
    strategy = jaxstrategy.OneDeviceStrategy(device=device)  # Raises InvalidDeviceError first.
    heading(f"OneDeviceStrategy(device={device!r})")
    print(f"strategy: {strategy!r}")
    print(f"strategy.device: {strategy.device}")
    print(f"extended.worker_devices: {strategy.extended.worker_devices}")
    return strategy


def show_device_forms() -> None:
    """Args: device, 'Examples: "/cpu:0", "/gpu:0", "/device:CPU:0", "/device:GPU:0"'."""
    heading("Args: device forms from the spec")
    for form in ("/cpu:0", "/gpu:0", "/device:CPU:0", "/device:GPU:0"):
        try:
            print(f"{form!r} -> {jaxstrategy.OneDeviceStrategy(form).device}")
        except jaxstrategy.InvalidDeviceError:
            # TensorFlow accepts it and computes elsewhere; here it is an error naming the devices.
            print(f"{form!r} -> InvalidDeviceError: no such device in this process")


def show_scope(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """with strategy.scope(): v = tf.Variable(1.0); print(v.device)."""
    heading("scope(): a variable created inside")
    with strategy.scope():
        v = strategy.put(1.0)  # A variable: committed to the strategy's device.
        w = jnp.asarray(1.0)  # Any array made in the scope lands on the device too (uncommitted).
        current = jaxstrategy.get_strategy()
    print(f"v = strategy.put(1.0): value {v.tolist()}, dtype {v.dtype}, {where(v)}")
    print(f"w = jnp.asarray(1.0): value {w.tolist()}, dtype {w.dtype}, {where(w)}")
    # TensorFlow prints v.device as a canonical name; jaxstrategy gives those names for the
    # strategy's devices in `extended`.
    names = dict(zip(strategy.devices, strategy.extended.parameter_devices, strict=True))
    (device,) = v.devices()
    print(f"v.device as TensorFlow names it: {names[device]}")
    print(f"get_strategy() is strategy inside scope: {current is strategy}")


def show_run_loop(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """def step_fn(x): return x * 2; result += strategy.run(step_fn, args=(i,)); print(result)."""
    heading("run(): the step_fn loop")

    def step_fn(x: Any) -> Any:
        return x * 2

    result: Any = 0
    for i in range(10):
        result += strategy.run(step_fn, args=(i,))
    print(f"result: {result.tolist()}")
    print(f"result is a jax array: dtype {result.dtype}, shape {result.shape}, {where(result)}")


def show_reduce(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """t = tf.range(10); strategy.reduce(tf.distribute.ReduceOp.SUM, t, axis=None / axis=0)."""
    heading("reduce(ReduceOp.SUM, tf.range(10), axis=None / axis=0)")
    t = jnp.arange(10)
    result = strategy.reduce(jaxstrategy.ReduceOp.SUM, t, axis=None)
    print(f"axis=None: {result.tolist()}")
    result = strategy.reduce(jaxstrategy.ReduceOp.SUM, t, axis=0)
    print(f"axis=0: {result.tolist()}")


def show_local_results(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """experimental_local_results(value): with one device, `(value,)`."""
    heading("experimental_local_results(value)")
    value = strategy.run(lambda x: x + 1, args=(jnp.arange(3),))
    local = strategy.experimental_local_results(value)
    print(f"of a run() result: {local_values(strategy, value)}, len {len(local)}")
    print(f"local[0] is value: {local[0] is value}")
    with strategy.scope():
        v = strategy.put(1.0)
    print(f"of a variable created in scope: {local_values(strategy, v)}")


def show_gather(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """gather(distributed_values, axis) for the spec's two examples."""
    # The spec runs these with MirroredStrategy over 2 and 4 GPUs, which jaxstrategy does not have
    # yet. With one replica there is nothing to concatenate: gather returns its input unchanged,
    # where 4 replicas would give shapes (4, 2, 3), (1, 8, 3) and (1, 2, 12).
    heading("gather(): the [[1], [2]] example (spec: 2 GPUs, shape (4, 1))")
    distributed_values = strategy.experimental_distribute_values_from_function(
        lambda _: jnp.asarray([[1], [2]])
    )
    result = strategy.gather(distributed_values, axis=0)
    print(f"axis=0: shape {result.shape}, value {result.tolist()}")

    heading("gather(): reshape(range(6), (1, 2, 3)) for axis 0, 1, 2 (spec: 4 GPUs)")
    single_tensor = jnp.reshape(jnp.arange(6), (1, 2, 3))
    distributed_values = strategy.experimental_distribute_values_from_function(lambda _: single_tensor)
    for axis in range(3):
        result = strategy.gather(distributed_values, axis=axis)
        print(f"axis={axis}: shape {result.shape}, dtype {result.dtype}, value {result.tolist()}")


def show_values_from_function(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """experimental_distribute_values_from_function(value_fn) for the spec's value_fn examples."""
    # The spec runs these with MirroredStrategy(["GPU:0", "GPU:1"]), giving 2-tuples such as
    # (3.0, 2.0) and (2, 2). OneDeviceStrategy has one replica, so each local result is a 1-tuple.
    heading("experimental_distribute_values_from_function: constant value per replica")

    def constant_fn(ctx: jaxstrategy.ValueContext) -> Any:
        return jnp.asarray(1.0)

    distributed_values = strategy.experimental_distribute_values_from_function(constant_fn)
    print(f"local_result: {local_values(strategy, distributed_values)}, {where(distributed_values)}")

    heading("experimental_distribute_values_from_function: array_value[ctx.replica_id_in_sync_group]")
    array_value = np.array([3.0, 2.0, 1.0])

    def indexed_fn(ctx: jaxstrategy.ValueContext) -> Any:
        return array_value[ctx.replica_id_in_sync_group]

    distributed_values = strategy.experimental_distribute_values_from_function(indexed_fn)
    print(f"local_result: {local_values(strategy, distributed_values)}")

    heading("experimental_distribute_values_from_function: ctx.num_replicas_in_sync")

    def count_fn(ctx: jaxstrategy.ValueContext) -> Any:
        return ctx.num_replicas_in_sync

    distributed_values = strategy.experimental_distribute_values_from_function(count_fn)
    print(f"local_result: {local_values(strategy, distributed_values)}")

    heading("experimental_distribute_values_from_function: values placed on worker_devices")
    # The spec uses `with tf.device(worker_devices[i])`; JAX takes the jax.Device itself.
    multiple_values = []
    for i in range(strategy.num_replicas_in_sync):
        with jax.default_device(strategy.devices[i]):
            multiple_values.append(jnp.asarray(1.0))

    def placed_fn(ctx: jaxstrategy.ValueContext) -> Any:
        return multiple_values[ctx.replica_id_in_sync_group]

    distributed_values = strategy.experimental_distribute_values_from_function(placed_fn)
    print(f"local_result: {local_values(strategy, distributed_values)}, {where(distributed_values)}")


def show_attributes(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """Attributes: cluster_resolver (None for single-worker strategies) and num_replicas_in_sync."""
    heading("Attributes: cluster_resolver, num_replicas_in_sync")
    print(f"cluster_resolver: {strategy.cluster_resolver}")
    print(f"num_replicas_in_sync: {strategy.num_replicas_in_sync}")


def show_replica_context(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """run(fn): fn runs in the replica context; get_replica_context() gives its id and collectives."""
    heading("run(): get_replica_context() inside the function")

    def replica_fn(x: Any) -> dict[str, Any]:
        ctx = jaxstrategy.get_replica_context()
        assert ctx is not None  # None only in a scope outside run().
        return {
            "replica_id_in_sync_group": ctx.replica_id_in_sync_group,
            "all_reduce SUM": ctx.all_reduce(jaxstrategy.ReduceOp.SUM, x),
            "all_reduce MEAN": ctx.all_reduce(jaxstrategy.ReduceOp.MEAN, x),
        }

    outputs = strategy.run(replica_fn, args=(jnp.arange(3),))
    for name in ("replica_id_in_sync_group", "all_reduce SUM", "all_reduce MEAN"):
        print(f"{name}: {outputs[name].tolist()} ({outputs[name].dtype})")
    with strategy.scope():
        print(f"get_replica_context() in scope, outside run: {jaxstrategy.get_replica_context()}")
        print(f"in_cross_replica_context() in scope: {jaxstrategy.in_cross_replica_context()}")


def show_distribute_dataset(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """dataset = tf.data.Dataset.range(10).batch(2); for x in dist_dataset: print(x)."""
    heading("experimental_distribute_dataset(range(10) in batches of 2)")
    dataset = np.arange(10).reshape(5, 2)  # Any iterable of batches; a tf.data Dataset works too.
    dist_dataset = strategy.experimental_distribute_dataset(dataset)
    for x in dist_dataset:
        print(f"{x.tolist()} {where(x)}")


def show_datasets_from_function(strategy: jaxstrategy.OneDeviceStrategy) -> None:
    """inputs = strategy.distribute_datasets_from_function(dataset_fn); run(replica_fn, (batch,))."""
    heading("distribute_datasets_from_function(dataset_fn)")
    global_batch_size = 4

    def dataset_fn(input_context: jaxstrategy.InputContext) -> Any:
        print(f"dataset_fn called with {input_context!r}")
        batch_size = input_context.get_per_replica_batch_size(global_batch_size)
        # The spec's from_tensors([[1.]]).repeat().batch(batch_size), three batches of it.
        return [np.ones((batch_size, 1), np.float32)] * 3

    def replica_fn(batch: jax.Array) -> jax.Array:
        return jnp.sum(batch)

    inputs = strategy.distribute_datasets_from_function(dataset_fn)
    for batch in inputs:
        replica_results = strategy.run(replica_fn, args=(batch,))
        print(f"replica_results: {local_values(strategy, replica_results)}")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Run the examples of the OneDeviceStrategy doc page.")
    parser.add_argument(
        "--device", default="/cpu:0", help="the device to run on, e.g. /cpu:0 or /gpu:0 (default: /cpu:0)"
    )
    args = parser.parse_args(argv)
    print("jaxstrategy: the examples of TensorFlow's tf.distribute.OneDeviceStrategy doc page")
    try:
        strategy = show_construction(args.device)
    except jaxstrategy.InvalidDeviceError as error:
        parser.error(str(error))  # Exits with status 2, the message on stderr.
    show_device_forms()
    show_scope(strategy)
    show_run_loop(strategy)
    show_reduce(strategy)
    show_local_results(strategy)
    show_gather(strategy)
    show_values_from_function(strategy)
    show_attributes(strategy)
    show_replica_context(strategy)
    show_distribute_dataset(strategy)
    show_datasets_from_function(strategy)


if __name__ == "__main__":
    main()
