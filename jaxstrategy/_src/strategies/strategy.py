"""`Strategy`: the TensorFlow-shaped methods every strategy shares, as thin checked facades.

Each method checks its arguments and context eagerly (before anything is traced), then hands
off to module-level functions or to the strategy's two parts: its placement and its job.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any, cast

import jax

from jaxstrategy._src.core.errors import caller_stacklevel
from jaxstrategy._src.core.types import PyTree, StepFn
from jaxstrategy._src.input import datasets
from jaxstrategy._src.input.datasets import DistributedDataset
from jaxstrategy._src.input.replica_batches import ReplicaLayout
from jaxstrategy._src.steps import nnx_objects
from jaxstrategy._src.steps.cache import NeedsSlowPath, StepCache
from jaxstrategy._src.strategies.job import Job, StrategyExtended
from jaxstrategy._src.strategies.placement import Placement
from jaxstrategy._src.strategies.run_path import RunPath, RunsSteps
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.contexts import InputContext, ReplicaContext, ValueContext
from jaxstrategy._src.values.options import InputOptions, RunOptions
from jaxstrategy._src.values.reduce_op import ReduceOp, as_reduce_op
from jaxstrategy._src.values.variables import place_tree


class Strategy:
    """The `tf.distribute.Strategy` API over JAX devices; see `OneDeviceStrategy`.

    A strategy is a placement (where values live, how trees are laid out, what a replica runs:
    `placement.py`) and a job (who takes part: `job.py`). Its methods check their arguments and
    context, then hand the work to those two parts; the public classes choose them.
    """

    def __init__(self, placement: Placement, job: Job):
        self._placement = placement
        self._job = job
        name = type(self).__name__
        job.take_part(placement, name)
        caller = f"{name}.run()"
        self._run_steps = StepCache(
            in_shardings=placement.run_input_shardings(caller),
            out_shardings=placement.run_output_sharding,
            program=self._run_program,
            caller=caller,
            in_flight_limit=placement.in_flight_limit,
            layout_key=placement.run_layout_key,
        )
        self._run_path: RunsSteps = job.run_path(
            RunPath(self, self._run_steps, before_checked_path=job.before_checked_run, caller=caller)
        )
        caller = f"{name}.init()"
        self._init_steps = StepCache(
            in_shardings=placement.init_input_shardings(caller),
            out_shardings=placement.init_output_sharding,
            program=functools.partial(placement.init_program, owner=self, caller=caller),
            caller=caller,
            scalars_are_static=True,
        )

    def _run_program(self, fn: StepFn) -> StepFn:
        """What `run` compiles of `fn`: the placement's replica program, seen by the job's program
        check, refusing, when traced, NNX objects nested in the arguments.

        `run`'s hot path looks at the top-level arguments only (it runs every step); a Module
        inside a dict would reach a step compiled for arrays as a plain pytree, and its updates
        would be lost. This check costs nothing per step: it runs when a call traces.
        """
        caller = f"{type(self).__name__}.run()"
        program = self._job.traced_program(fn, self._placement.replica_program(fn, self, caller))

        def refusing_nested_objects(*args: Any, **kwargs: Any) -> PyTree:
            if nnx_objects.find_objects((args, kwargs)) is not None:
                raise NeedsSlowPath("NNX objects among the arguments: run unpacks them.")
            return program(*args, **kwargs)

        return refusing_nested_objects

    def _default_device_scope(self) -> contextlib.AbstractContextManager[Any]:
        """Make arrays created in `scope()` land on this strategy's device (`StrategyLike`)."""
        return jax.default_device(self._placement.default_device())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._placement.key == self._placement.key

    def __hash__(self) -> int:
        return hash((type(self), self._placement.key))

    # The facts.

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The devices this strategy computes on, in replica order."""
        return self._placement.devices

    @property
    def sharding(self) -> jax.sharding.Sharding:
        """Where a value held whole by every replica lives (variables, on the strategies that
        do not split them)."""
        return self._placement.sharding

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """The `jax.sharding.Mesh` of the devices; its first axis is `'replica'`."""
        return self._placement.mesh

    # Shared behaviour.

    @property
    def num_replicas_in_sync(self) -> int:
        """The number of replicas over which gradients are aggregated."""
        return self._placement.num_replicas

    @property
    def cluster_resolver(self) -> Any:
        """The cluster resolver of a multi-worker strategy; None for single-process strategies."""
        return self._job.cluster_resolver

    @property
    def extended(self) -> StrategyExtended:
        """TensorFlow's `StrategyExtended` facts: device names and this process's roles.

        On a strategy of several processes, `worker_devices` are this process's devices, named
        in its job and task as TensorFlow names them, and only the chief (process 0, never an
        evaluator) should write what one process writes (logs, summaries); each process runs
        its own copy of the program (`experimental_between_graph`). Every process must still
        call `checkpoint.save`.
        """
        return self._job.extended(self._placement)

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this strategy current, and its device JAX's default, for the `with` block.

        Inside, `jaxstrategy.get_strategy()` returns this strategy and arrays created by JAX land
        on its device (uncommitted, as under `jax.default_device`). Entering the scope of the same
        strategy again is allowed, also through the same `scope()` object, as in TensorFlow;
        another strategy's scope, or a scope inside `run`, is an error.

        The current strategy is a context variable, so asyncio tasks inherit it and new threads
        start without it; JAX's default device is per thread. So when asyncio tasks interleave
        inside and outside a scope, arrays they create may land on the scope's device; pass
        arrays through `put` (or `run`) to place them explicitly.

        Raises:
          StrategyContextError: (a `RuntimeError`) inside another strategy's scope, or inside
            `run`.

        Example:
          >>> import jax.numpy as jnp, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy('/cpu:0')
          >>> with strategy.scope() as current:
          ...     v = jnp.ones(3)
          >>> current is strategy, v.devices() == {strategy.device}
          (True, True)
        """
        return contexts.StrategyScope(self)

    def run(
        self,
        fn: StepFn,
        args: tuple[Any, ...] | list[Any] = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> PyTree:
        """Run `fn(*args, **kwargs)` compiled on the strategy's device(s), and return its outputs there.

        `fn` is traced and compiled once per strategy (a bound method passed afresh each step
        counts as the same function) and replayed afterwards, so Python side effects in `fn` happen
        only while it is traced. Flax NNX objects among the arguments (a Module, an Optimizer,
        `nnx.Rngs`) are updated in place, as under `nnx.jit`: after `run` they hold what `fn` left
        in their Variables. Every other argument is a value: return new state and rebind it. A
        bound method's object is read when the method is traced: later changes to its
        attributes are not seen. While traced, `fn` runs in the replica context:
        `jaxstrategy.get_replica_context()` gives the replica id and collectives.

        Array-likes (jax and numpy arrays and scalars, Python bool/int/float/complex) are traced
        and placed on the device, so a new Python int does not recompile and arrays committed to
        another device are copied here. Other leaves (strings, enums, configs) are compile-time
        constants and must be hashable. A Python bool is traced, so `if training:` fails: name such
        a flag in `RunOptions(static_argnames=...)`, or pass a string or an `enum.Enum` member.
        TensorFlow returns `fn`'s raw Python result; here outputs are jax arrays committed to the
        device.

        Args:
          fn: the function to run; it must return a pytree of arrays.
          args: positional arguments, a tuple or list.
          kwargs: keyword arguments, a dict.
          options: a `RunOptions`; `donate_argnums` / `donate_argnames` donate buffers, and
            `static_argnums` / `static_argnames` make arguments compile-time constants.

        Returns:
          `fn`'s outputs, as jax arrays committed to the device (on `MirroredStrategy`, outputs
          that may differ between replicas come back as `PerReplica`).

        Raises:
          TypeError: `fn` is not callable; `kwargs` or `options` has the wrong type; an argument
            that is not an array is not hashable (each such argument is named by path).
          ValueError: `args` is not a tuple or list; a donated array is passed twice; `fn`
            updates an NNX object with values that may differ between replicas, or changes an
            object's structure (adds an attribute or a Variable).
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> fn = lambda x, scale: {'y': x * scale}
          >>> out = strategy.run(fn, args=(3,), kwargs={'scale': 2.0})
          >>> out['y'].tolist(), out['y'].committed
          (6.0, True)

          An NNX object is updated in place:

          >>> from flax import nnx
          >>> counter = strategy.put(nnx.Linear(1, 1, rngs=nnx.Rngs(0)))
          >>> def add_one(layer):
          ...     layer.bias[...] = layer.bias[...] + 1
          >>> for _ in range(3):
          ...     strategy.run(add_one, args=(counter,))
          >>> counter.bias[...].tolist()
          [3.0]
        """
        return self._run_path.run(fn, args, kwargs, options)

    def reduce(self, reduce_op: ReduceOp | str, value: PyTree, axis: Any) -> PyTree:
        """Combine `value` across replicas, and along `axis` within each replica unless it is None.

        A `PerReplica` leaf combines its components: SUM adds them, MEAN averages them (as the
        global sum over the global count when `axis` is given). Any other leaf stands for the
        same value on every replica: SUM multiplies it by the number of replicas (as TensorFlow
        does with an axis; without one it raises) and MEAN returns it as it is. With an axis (an
        int or a tuple of ints), every leaf must be an array with that axis; MEAN of integers
        gives JAX's default float (TensorFlow gives float64).

        On `OneDeviceStrategy` reducing across its one replica is a no-op: with `axis=None`,
        `value` is returned unchanged, whatever it is.

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`, or its name in any case.
          value: a pytree of arrays and `PerReplica`s, such as `run`'s result.
          axis: required, as in TensorFlow: None, or the axis (or axes) of each replica's value
            to reduce as well.

        Returns:
          The reduced pytree, committed to `self.sharding` (on `MirroredStrategy`, replicated on
          every device); on `OneDeviceStrategy` with `axis=None`, `value` itself.

        Raises:
          ValueError: an unknown reduce op name; an axis out of range for a leaf, or a scalar leaf
            with an axis (each such leaf is named).
          TypeError: `reduce_op` of the wrong type; a leaf that is not an array (on
            `OneDeviceStrategy`, only with an axis).
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import jax.numpy as jnp, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> t = jnp.arange(10)
          >>> strategy.reduce(jaxstrategy.ReduceOp.SUM, t, axis=None).tolist()
          [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
          >>> strategy.reduce('sum', t, axis=0).tolist()
          45

          On two replicas, a `PerReplica` combines its components:

          >>> mirrored = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
          >>> losses = mirrored.experimental_distribute_values_from_function(
          ...     lambda context: jnp.float32(context.replica_id_in_sync_group + 1))
          >>> [mirrored.reduce(op, losses, axis=None).tolist() for op in ('sum', 'mean')]
          [3.0, 1.5]
        """
        caller = f"{type(self).__name__}.reduce()"
        contexts.require_cross_replica_context(
            self,
            caller,
            in_run_hint="Use jaxstrategy.get_replica_context().all_reduce() inside run, or "
            "return the value from run and reduce it outside.",
        )
        return self._placement.reduce(as_reduce_op(reduce_op, caller=caller), value, axis, caller)

    def gather(self, value: PyTree, axis: int) -> PyTree:
        """Concatenate the replicas' values of `value` along `axis`, in replica order.

        A leaf that is not a `PerReplica` is the same on every replica, so its copies are
        concatenated; on `OneDeviceStrategy`, with one replica, `value` comes back unchanged.
        Every leaf must be an array with an axis `axis`, however many replicas there are
        (TensorFlow's OneDeviceStrategy accepts scalars and any axis here, so code that fails on
        many devices would pass on one).

        Args:
          value: a pytree of arrays (and `PerReplica`s) of rank 1 or more.
          axis: the axis to concatenate along, in [-rank, rank).

        Returns:
          The gathered pytree, committed to `self.sharding` (on `MirroredStrategy`, replicated on
          every device); on `OneDeviceStrategy`, `value` itself.

        Raises:
          ValueError: a scalar leaf, or `axis` out of a leaf's range.
          TypeError: a leaf that is not an array, or an `axis` that is not an int.
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import jax.numpy as jnp, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> strategy.gather(jnp.arange(6).reshape(1, 2, 3), axis=1).shape
          (1, 2, 3)

          On four replicas, each holding the same value:

          >>> mirrored = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1', '/cpu:2', '/cpu:3'])
          >>> value = mirrored.experimental_distribute_values_from_function(
          ...     lambda _: jnp.arange(6).reshape(1, 2, 3))
          >>> [mirrored.gather(value, axis).shape for axis in (0, 1, 2)]
          [(4, 2, 3), (1, 8, 3), (1, 2, 12)]
        """
        caller = f"{type(self).__name__}.gather()"
        contexts.require_cross_replica_context(
            self, caller, in_run_hint="Use jaxstrategy.get_replica_context().all_gather() inside run instead."
        )
        return self._placement.gather(value, axis, caller)

    def experimental_local_results(self, value: PyTree) -> tuple[PyTree, ...]:
        """Return the values of `value` on this process's replicas: one tree per replica.

        With one replica that is `(value,)`. With several, a `PerReplica` leaf gives each replica
        its component, and an array replicated on the strategy's devices its copy on the
        replica's device; any other leaf is repeated (TensorFlow returns a plain leaf once, as
        `(value,)`; here it is always one per replica). With several processes, each gets its
        own replicas' values, as in TensorFlow. Of a replica of `MultiWorkerShardedStrategy` that
        spans processes, a value this process holds whole (a component, or a variable split only
        within the process) comes back on this process's devices of the replica, and a variable
        split between the processes as the replica's array, of which this process holds its own
        shards (gather it to the host with
        `jax.experimental.multihost_utils.process_allgather`, on every process).

        Example:
          >>> import jaxstrategy
          >>> jaxstrategy.OneDeviceStrategy().experimental_local_results({'loss': 1.0})
          ({'loss': 1.0},)
          >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
          >>> replica_id = lambda: jaxstrategy.get_replica_context().replica_id_in_sync_group
          >>> ids = strategy.run(replica_id)
          >>> [(int(i), i.devices()) for i in strategy.experimental_local_results(ids)]
          [(0, {CpuDevice(id=0)}), (1, {CpuDevice(id=1)})]
        """
        return self._placement.local_results(value, f"{type(self).__name__}.experimental_local_results()")

    def experimental_distribute_values_from_function(
        self, value_fn: Callable[[ValueContext], PyTree]
    ) -> PyTree:
        """Call `value_fn` once per replica with its `ValueContext` and distribute the results.

        On one device, the result comes back with its array-like leaves placed on the device,
        and other leaves as they are (TensorFlow returns the raw result there). On several
        replicas, array leaves become `PerReplica`s, each replica's component on its own
        device(s); they must have the same shape and dtype on every replica (one program runs on
        all of them), and a leaf that is not an array must be equal on every replica and is
        returned as it is. With several processes, each process calls `value_fn` for its own
        replicas only (with their global replica ids) and can compare only their results, so
        results must agree across processes by construction; Python numbers become arrays of
        JAX's default dtypes there, rather than weakly typed ones. Processes that share a
        replica (of a `MultiWorkerShardedStrategy` spanning them) each call `value_fn` for it,
        and must return the same values.

        Raises:
          TypeError: `value_fn` is not callable; a leaf that is not an array differs between
            replicas.
          ValueError: the replicas' results differ in structure, shape or dtype; or processes
            that share a replica gave it different values.

        Example:
          >>> import jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> value = strategy.experimental_distribute_values_from_function(
          ...     lambda context: context.num_replicas_in_sync)
          >>> strategy.experimental_local_results(value)[0].tolist()
          1
          >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
          >>> value = strategy.experimental_distribute_values_from_function(
          ...     lambda context: context.replica_id_in_sync_group * 10)
          >>> [int(v) for v in strategy.experimental_local_results(value)]
          [0, 10]
        """
        caller = f"{type(self).__name__}.experimental_distribute_values_from_function()"
        value, to_compare = self._placement.distribute_values(value_fn, caller)
        self._job.compare_values(to_compare, caller)
        return value

    def _batch_layout(self) -> ReplicaLayout:
        """How distributed datasets lay batches out: the placement's, with the job's timeout."""
        return self._job.batch_layout(self._placement.batch_layout)

    def experimental_distribute_dataset(
        self, dataset: Any, options: InputOptions | None = None
    ) -> DistributedDataset:
        """Wrap `dataset` so that its batches arrive on the device(s), prefetched in the background.

        `dataset` is any iterable of batches, each a pytree of arrays: a list, a generator, numpy
        arrays, a `tf.data.Dataset`, a torch `DataLoader` or a Grain loader (leaves with
        `__array__` or `.numpy()`); none of those libraries is imported. Every `iter()` starts a
        fresh pass with a background thread that keeps
        `options.experimental_per_replica_buffer_size` batches (2 by default: double buffering)
        placed ahead of the step; on CPU devices, a source already in memory (a list, tuple or
        numpy array) is placed on the calling thread instead, by default, since there a thread
        only takes cores from the step. A one-shot source (a generator object) allows one pass; a second
        is an error.

        Each batch is a global batch. On `OneDeviceStrategy` it arrives whole, a partial last
        batch included. On `MirroredStrategy` (on any number of devices) it is split along its
        first axis with one sharded `device_put` and arrives as a `PerReplica`, one slice per
        replica; a batch the replicas do not divide is a `ValueError` when it is reached, unless
        `options.partial_batch` is `"drop"` (skip it, with a warning) or `"pad"` (pad it and
        yield `(batch, mask)` pairs). On `MultiWorkerMirroredStrategy` every process reads the
        same source and keeps its own replicas' parts of each global batch.

        Args:
          dataset: the source of batches.
          options: an `InputOptions`; `experimental_fetch_to_device=False` yields host numpy arrays,
            `experimental_per_replica_buffer_size=0` turns the background thread off.

        Returns:
          A `DistributedDataset`.

        Raises:
          TypeError: `dataset` is not iterable, or `options` is not an `InputOptions`.
          NotImplementedError: `InputReplicationMode.PER_REPLICA`, as in TensorFlow.
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import numpy as np, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> dist_dataset = strategy.experimental_distribute_dataset(np.arange(10).reshape(5, 2))
          >>> for x in dist_dataset:
          ...     print(x.tolist(), x.committed)
          [0, 1] True
          [2, 3] True
          [4, 5] True
          [6, 7] True
          [8, 9] True
        """
        caller = f"{type(self).__name__}.experimental_distribute_dataset()"
        options = datasets.input_options(options, caller, per_replica_supported=False)
        contexts.require_cross_replica_context(
            self, caller, in_run_hint="Distribute the dataset outside run()."
        )
        return datasets.distribute_dataset(
            dataset, layout=self._batch_layout(), options=options, caller=caller
        )

    def experimental_distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Deprecated, as in TensorFlow: the old name of `distribute_datasets_from_function`.

        Warns with a `DeprecationWarning`, then does the same.

        Example:
          >>> import warnings, numpy as np, jaxstrategy
          >>> with warnings.catch_warnings(record=True) as caught:
          ...     warnings.simplefilter('always')
          ...     strategy = jaxstrategy.OneDeviceStrategy()
          ...     inputs = strategy.experimental_distribute_datasets_from_function(
          ...         lambda context: [np.ones(2)])
          >>> caught[0].category.__name__, [batch.shape for batch in inputs]
          ('DeprecationWarning', [(2,)])
        """
        warnings.warn(
            f"{type(self).__name__}.experimental_distribute_datasets_from_function() is deprecated, as "
            "in TensorFlow: call distribute_datasets_from_function() instead, which does the same.",
            DeprecationWarning,
            stacklevel=caller_stacklevel(),
        )
        return self.distribute_datasets_from_function(dataset_fn, options)

    def distribute_datasets_from_function(
        self, dataset_fn: Callable[[InputContext], Any], options: InputOptions | None = None
    ) -> DistributedDataset:
        """Call `dataset_fn` once per input pipeline with its `InputContext`; distribute the result.

        With one process there is one pipeline: `dataset_fn` is called once, with
        `InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=...)`. Its
        elements are per-replica batches, never split: on several replicas, replica `i` of each
        step takes the `i`-th of `num_replicas_in_sync` consecutive elements, as in TensorFlow, and
        elements left over for fewer than all replicas follow `options.partial_batch`. With
        `InputReplicationMode.PER_REPLICA`, `dataset_fn` is called once per replica instead, and
        replica `i` reads the `i`-th dataset. Batches are prefetched as by
        `experimental_distribute_dataset`.

        On `MultiWorkerMirroredStrategy` each process is one pipeline
        (`num_input_pipelines=jax.process_count()`, `input_pipeline_id=jax.process_index()`)
        whose elements go to that process's replicas in the same way, and the processes' inputs
        end at the same step: where one runs out first, all stop there, with a warning.

        Raises:
          TypeError: `dataset_fn` is not callable or returns something that is not iterable.
          NotImplementedError: `InputReplicationMode.PER_REPLICA` on `OneDeviceStrategy`, as in
            TensorFlow.
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import numpy as np, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> def dataset_fn(input_context):
          ...     batch_size = input_context.get_per_replica_batch_size(4)
          ...     return [np.ones(batch_size)] * 3
          >>> inputs = strategy.distribute_datasets_from_function(dataset_fn)
          >>> [batch.shape for batch in inputs]
          [(4,), (4,), (4,)]
        """
        caller = f"{type(self).__name__}.distribute_datasets_from_function()"
        if not callable(dataset_fn):
            raise TypeError(
                f"{caller}: dataset_fn must be a function of an InputContext returning the dataset; "
                f"got {type(dataset_fn).__name__}. To distribute a dataset itself, use "
                "experimental_distribute_dataset."
            )
        layout = self._batch_layout()
        options = datasets.input_options(options, caller, per_replica_supported=layout.stacked)
        contexts.require_cross_replica_context(
            self, caller, in_run_hint="Distribute the dataset outside run()."
        )
        return datasets.distribute_datasets_from_function(
            dataset_fn, layout=layout, input_pipeline=self._job.input_pipeline, options=options, caller=caller
        )

    def put(self, tree: PyTree) -> PyTree:
        """Return `tree` as variables: every leaf a jax array committed to `self.sharding`.

        On `MirroredStrategy` a `PerReplica` leaf stays one component per replica, split over
        them; every other leaf is replicated. A Flax NNX object (a Module, an Optimizer) in
        `tree` has its Variables committed in place and is returned itself.

        Numpy leaves bound for a CPU device are copied, because JAX may otherwise share their
        memory and a later write to the numpy array would change the variable. Every variable
        has device buffers of its own: a jax array already on the strategy's devices is copied
        there rather than shared, so donating a variable to `run` never deletes the array it was
        put from, nor another variable put from the same array.

        Raises:
          TypeError: a leaf is not an array-like; every such leaf is named by its path.
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import numpy as np, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> params = strategy.put({'w': np.zeros((2, 3)), 'b': 0.0})
          >>> params['w'].committed, params['b'].dtype.name
          (True, 'float32')
        """
        caller = f"{type(self).__name__}.put()"
        contexts.require_cross_replica_context(self, caller, in_run_hint="Call put() outside run().")

        def place(tree: PyTree) -> PyTree:
            shardings = self._placement.shardings_for(tree, caller=caller)
            return place_tree(tree, shardings, caller=caller, own_buffers=True)

        found = nnx_objects.find_objects(tree)
        return place(tree) if found is None else nnx_objects.put_objects(found, place)

    def init(self, fn: Callable[..., PyTree], *args: Any, **kwargs: Any) -> PyTree:
        """Return `fn(*args, **kwargs)` compiled, its outputs created directly on `self.sharding`.

        Parameters are never materialised on the host or another device first. `fn` is compiled
        once per strategy and its arguments follow the rules of `run`.

        Raises:
          TypeError: `fn` is not callable, or an argument that is not an array is not hashable.
          StrategyContextError: called inside `run`, or inside another strategy's scope.

        Example:
          >>> import jax, jaxstrategy
          >>> strategy = jaxstrategy.OneDeviceStrategy()
          >>> params = strategy.init(lambda key: jax.random.normal(key, (3,)), jax.random.key(0))
          >>> params.shape, params.committed
          ((3,), True)
        """
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}.init(): fn must be callable; got {fn!r}.")
        contexts.require_cross_replica_context(
            self, f"{type(self).__name__}.init()", in_run_hint="Call init() outside run()."
        )
        return self._init_steps(fn, args, kwargs)


def get_strategy() -> Strategy:
    """Return the current strategy: the one whose `scope()` is active, else a default one.

    The default is a `OneDeviceStrategy` on JAX's default device, so library code can always
    call `get_strategy().run(...)`. TensorFlow's default strategy is a special class; this one
    is an ordinary `OneDeviceStrategy`.

    Example:
      >>> import jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy('/cpu:0')
      >>> with strategy.scope():
      ...     jaxstrategy.get_strategy() is strategy
      True
      >>> jaxstrategy.get_strategy().num_replicas_in_sync
      1
    """
    # Only strategies become current: `scope()` enters `self`, `experimental_set_strategy` checks.
    return cast(Strategy, contexts.current_strategy())


def experimental_set_strategy(strategy: Strategy | None) -> None:
    """Make `strategy` current without a `with` block, as entering its `scope()` would; None undoes it.

    As in TensorFlow, it replaces the strategy it set before, and it must not be called inside
    a `scope()` (a strategy it set itself does not count). It applies to this thread (more
    precisely, this `contextvars` context): new threads start without a strategy.

    Raises:
      RuntimeError: called inside a strategy's `scope()` or inside `run`.
      TypeError: `strategy` is neither a strategy nor None.

    Example:
      >>> import jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy('/cpu:0')
      >>> jaxstrategy.experimental_set_strategy(strategy)
      >>> jaxstrategy.get_strategy() is strategy, jaxstrategy.in_cross_replica_context()
      (True, True)
      >>> jaxstrategy.experimental_set_strategy(None)
      >>> jaxstrategy.has_strategy()
      False
    """
    contexts.set_strategy(strategy)


def get_replica_context() -> ReplicaContext[Strategy] | None:
    """Return the replica context: the replica's inside `run`, None in a scope outside `run`.

    Outside every scope, a default context of the default strategy (replica 0 of 1) is returned,
    as TensorFlow does.

    Example:
      >>> import jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy()
      >>> with strategy.scope():
      ...     print(jaxstrategy.get_replica_context())
      None
      >>> def step(x):
      ...     context = jaxstrategy.get_replica_context()
      ...     return x + context.replica_id_in_sync_group
      >>> strategy.run(step, args=(10,)).tolist()
      10
    """
    # Only strategies become current (see `get_strategy`).
    return cast("ReplicaContext[Strategy] | None", contexts.current_replica_context())
