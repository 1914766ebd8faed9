"""values_test.py: distributed values (`experimental_distribute_values_from_function`, `PerReplica`)
and mirrored variables, on TF's one-device and mirrored stand-ins (combinations.py) and on
`multi_worker_mirrored_2x1_cpu` (a real job of two processes, cases in two_process_worker.py).

TF's `distribute.test_util.gather` (every replica's value stacked along a new axis) is
`two_process_worker.stack_replicas`. A tf.Variable under a strategy is a jax array placed with
`strategy.put` (replicated over the replicas: TF's MirroredVariable); checkpoints use
`jaxstrategy.checkpoint`. `PerReplica(values)` is `PerReplica(stacked)` here, the components stacked
along a new leading axis, so its components have one shape.

Skipped, as TF internals:
- DistributedValuesTest.testMakeDistributedValueSpareTensor: SparseTensor.
- DistributedDelegateTest: TF's private `DistributedDelegate` class (jaxstrategy's `PerReplica`
  has no arithmetic, as TF's does not).
- DistributedVariableTest.testExtendsVariable, testTraceback, testSelectReplica,
  testAssignReturnValueIsTensorLike, testAssignSignature, testStrategyExtendedUpdate,
  testSaveNonDistributed, testUnsaveable, and the synchronization/aggregation parameters of every
  DistributedVariableTest: tf.Variable's class, `assign*` methods, aggregation and
  synchronization, SavedModel signatures and `extended.update`.
- PackedDistributedVariableTest, MirroredVariableTest.testVariableOnAnotherDevice: private
  variable classes and constructors.
- SyncOnReadVariableTest: ON_READ variables.
- PerReplicaTest.testIsGraphTensor: graph mode. testCondWithTensorValues: string tensors, and
  branches of different shapes (jax.lax.cond needs branches of one type, a JAX rule).
  testCondWithValuesNotConvertibleToTensor: TF TypeSpecs of Python sets.
- The TPU, central-storage and GPU combinations (their one- and two-device behaviour runs on the
  CPU stand-ins).
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import PerReplica, checkpoint
from tf_parity import combinations as c
from tf_parity.test_strategy_test_lib import local
from tf_parity.two_process_worker import stack_replicas

TF_FILE = "values_test.py"
DISTRIBUTIONS = pytest.mark.parametrize(
    "distribution", c.all_strategies_minus_default, indirect=True, ids=str
)
MIRRORED = pytest.mark.parametrize(
    "distribution", [c.mirrored_strategy_with_gpu_and_cpu], indirect=True, ids=str
)


# --- DistributedValuesTest ---------------------------------------------------------------------


@DISTRIBUTIONS
def test_make_distributed_value_from_tensor(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueFromTensor"""
    single_value = jnp.int32(1)
    distributed_values = distribution.experimental_distribute_values_from_function(lambda ctx: single_value)
    assert stack_replicas(distribution, distributed_values) == [1] * distribution.num_replicas_in_sync


@DISTRIBUTIONS
def test_make_distributed_value_single_numpy_array_constant(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueSingleNumpyArrayConstant"""
    array_value = np.array([1.0, 2.0, 3.0])
    distributed_values = distribution.experimental_distribute_values_from_function(lambda ctx: array_value)
    assert (
        stack_replicas(distribution, distributed_values)
        == [[1.0, 2.0, 3.0]] * distribution.num_replicas_in_sync
    )


@DISTRIBUTIONS
def test_make_distributed_value_tuple_constant(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueTupleConstant"""
    tuple_value = (1.0, 2.0, 3.0)
    distributed_values = distribution.experimental_distribute_values_from_function(lambda ctx: tuple_value)
    n = distribution.num_replicas_in_sync
    # For two replicas: ([1.0, 1.0], [2.0, 2.0], [3.0, 3.0]).
    assert stack_replicas(distribution, distributed_values) == tuple([v] * n for v in tuple_value)


@DISTRIBUTIONS
def test_make_distributed_value_nested_structure_per_replica(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueNestedStructurePerReplica"""
    tuple_value = (1.0, 2.0, 3.0)

    def value_fn(ctx):
        return tuple(val * ctx.replica_id_in_sync_group for val in tuple_value)

    distributed_values = distribution.experimental_distribute_values_from_function(value_fn)
    n = distribution.num_replicas_in_sync
    # For two replicas: ([0.0, 1.0], [0.0, 2.0], [0.0, 3.0]).
    assert stack_replicas(distribution, distributed_values) == tuple(
        [v * i for i in range(n)] for v in tuple_value
    )


@DISTRIBUTIONS
def test_make_distributed_value_extract_from_array(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueExtractFromArray"""
    multiple_values = range(distribution.num_replicas_in_sync)
    distributed_values = distribution.experimental_distribute_values_from_function(
        lambda ctx: multiple_values[ctx.replica_id_in_sync_group]
    )
    assert stack_replicas(distribution, distributed_values) == list(range(distribution.num_replicas_in_sync))


@DISTRIBUTIONS
def test_make_distributed_value_and_run(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueAndRun (in one tf.function,
    here one jax.jit)"""

    @jax.jit
    def run():
        multiple_values = range(distribution.num_replicas_in_sync)
        distributed_values = distribution.experimental_distribute_values_from_function(
            lambda ctx: multiple_values[ctx.replica_id_in_sync_group]
        )
        outputs = distribution.run(lambda x: jnp.square(x)[None], args=(distributed_values,))
        return distribution.gather(outputs, axis=0)

    assert np.asarray(run()).tolist() == [i**2 for i in range(distribution.num_replicas_in_sync)]


@MIRRORED
def test_make_distributed_value_default_device_placement(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueDefaultDevicePlacement

    Departure: README, MirroredStrategy's table, "where `value_fn`'s results go". TF leaves a
    tensor made on the default device there, for every replica; here component i is on replica
    i's device, where one program over the mesh needs it.
    """
    distributed_values = distribution.experimental_distribute_values_from_function(
        lambda ctx: jnp.float32(1.0)
    )
    assert [v.devices() for v in distributed_values.values] == [{d} for d in distribution.devices]


@MIRRORED
def test_make_distributed_value_explicit_device_placement(distribution):
    """values_test.py: DistributedValuesTest.testMakeDistributedValueExplicitDevicePlacement"""
    worker_devices = distribution.devices  # The jax.Devices of extended.worker_devices.

    def value_fn(ctx):
        worker_device_id = ctx.replica_id_in_sync_group % len(worker_devices)
        return jax.device_put(jnp.float32(1.0), worker_devices[worker_device_id])

    distributed_values = distribution.experimental_distribute_values_from_function(value_fn)
    assert [v.devices() for v in distributed_values.values] == [{d} for d in worker_devices]


# --- DistributedVariableTest -------------------------------------------------------------------

VARIABLE_DISTRIBUTIONS = pytest.mark.parametrize(
    "distribution",
    [c.mirrored_strategy_with_one_cpu, c.mirrored_strategy_with_gpu_and_cpu],
    indirect=True,
    ids=str,
)


@VARIABLE_DISTRIBUTIONS
def test_checkpointing(distribution, tmp_path):
    """values_test.py: DistributedVariableTest.testCheckpointing: save, assign the inverted value,
    restore: the saved value is back, on every replica."""
    with distribution.scope():
        v = distribution.put(jnp.array([1.0, 2.0, 3.0, 4.0], jnp.float32))
    before_save = np.asarray(v).tolist()
    checkpoint.save(tmp_path, {"v": v})
    v = distribution.put(jnp.array([4.0, 3.0, 2.0, 1.0], jnp.float32))
    assert np.asarray(v).tolist() != before_save
    v = checkpoint.restore(tmp_path, strategy=distribution, target={"v": v})["v"]
    assert local(distribution, v) == [before_save] * distribution.num_replicas_in_sync


@VARIABLE_DISTRIBUTIONS
def test_is_tensor_like(distribution):
    """values_test.py: DistributedVariableTest.testIsTensorLike (a jax.Array in the cross-replica
    context and in the replica context)"""
    with distribution.scope():
        v = distribution.put(0.0)
    assert isinstance(v, jax.Array)
    seen = []

    def check(v):
        seen.append(isinstance(v, jax.Array))
        return v

    distribution.run(check, args=(v,))
    assert seen == [True]


@VARIABLE_DISTRIBUTIONS
def test_deep_copy(distribution):
    """values_test.py: DistributedVariableTest.testDeepCopy (a copy made in or out of the scope is
    another array with the same values on the same devices)"""
    with distribution.scope():
        v = distribution.put(jnp.float32(0.0))
        in_dist_copy = copy.deepcopy(v)
    out_dist_copy = copy.deepcopy(v)
    for v2 in (in_dist_copy, out_dist_copy):
        assert isinstance(v2, type(v))
        assert v2.sharding == v.sharding
        v1_values = distribution.experimental_local_results(v)
        v2_values = distribution.experimental_local_results(v2)
        assert len(v1_values) == len(v2_values)
        for v1v, v2v in zip(v1_values, v2_values, strict=True):
            assert v1v.devices() == v2v.devices()
            assert v1v is not v2v
            assert v1v.unsafe_buffer_pointer() != v2v.unsafe_buffer_pointer()
            assert float(v1v) == float(v2v)


# --- MirroredVariableTest and MirroredVariableSaveRestoreTest -----------------------------------


@MIRRORED
def test_mirrored_variable_properties(distribution):
    """values_test.py: MirroredVariableTest.testProperties (a component has the variable's dtype and
    shape; TF's names have no counterpart)"""
    mirrored = distribution.put(jnp.array([1.0], jnp.float32))
    v = distribution.experimental_local_results(mirrored)[0]
    assert v.dtype == mirrored.dtype
    assert v.shape == mirrored.shape


def _save(tmp_path, value):
    return checkpoint.save(tmp_path, {"v": value})


@MIRRORED
def test_save_and_restore_mirrored_one_graph(distribution, tmp_path):
    """values_test.py: MirroredVariableSaveRestoreTest.testSaveAndRestoreMirroredOneGraph (TF's
    replicas hold [3, 4] and it saves the first; here every replica holds 3)"""
    mirrored = distribution.put(3.0)
    _save(tmp_path, mirrored)
    mirrored = distribution.put(5.0)
    mirrored = checkpoint.restore(tmp_path, strategy=distribution, target={"v": mirrored})["v"]
    assert local(distribution, mirrored) == [3.0, 3.0]


@MIRRORED
def test_save_mirrored_restore_mirrored(distribution, tmp_path):
    """values_test.py: MirroredVariableSaveRestoreTest.testSaveMirroredRestoreMirrored"""
    _save(tmp_path, distribution.put(3.0))
    restored = checkpoint.restore(tmp_path, strategy=distribution, target={"v": distribution.put(7.0)})["v"]
    assert local(distribution, restored) == [3.0, 3.0]


@MIRRORED
def test_save_mirrored_restore_normal(distribution, tmp_path):
    """values_test.py: MirroredVariableSaveRestoreTest.testSaveMirroredRestoreNormal (a variable
    saved mirrored restores as a plain one, on one device)"""
    _save(tmp_path, distribution.put(3.0))
    normal = jaxstrategy.OneDeviceStrategy("/cpu:0")
    restored = checkpoint.restore(tmp_path, strategy=normal, target={"v": normal.put(8.0)})["v"]
    assert float(restored) == 3.0
    assert restored.devices() == {normal.device}


@MIRRORED
def test_save_normal_restore_mirrored(distribution, tmp_path):
    """values_test.py: MirroredVariableSaveRestoreTest.testSaveNormalRestoreMirrored"""
    _save(tmp_path, jaxstrategy.OneDeviceStrategy("/cpu:0").put(3.0))
    restored = checkpoint.restore(tmp_path, strategy=distribution, target={"v": distribution.put(7.0)})["v"]
    assert local(distribution, restored) == [3.0, 3.0]
    assert restored.sharding == distribution.sharding


# --- MirroredTest ------------------------------------------------------------------------------


@MIRRORED
def test_add_op(distribution):
    """values_test.py: MirroredTest.testAddOp (a value mirrored on two devices, 3.0)"""
    mirrored_val = distribution.put(3.0)
    assert float(mirrored_val + mirrored_val) == 6.0
    assert float(mirrored_val + 1) == 4.0
    assert float(mirrored_val + 1) == float(jnp.add(mirrored_val, 1))
    assert type(mirrored_val + 1) is type(jnp.add(mirrored_val, 1))


# --- PerReplicaTest ----------------------------------------------------------------------------


def test_type_spec():
    """values_test.py: PerReplicaTest.testTypeSpec (the abstract value of a PerReplica of one float32
    scalar describes that component)"""
    per_replica = PerReplica(jnp.array([1.0], jnp.float32))
    spec = jax.eval_shape(lambda x: x, per_replica)
    assert isinstance(spec, PerReplica)
    assert (spec.stacked.shape[1:], spec.stacked.dtype) == ((), jnp.float32)


def test_type_spec_round_trip():
    """values_test.py: PerReplicaTest.testTypeSpecRoundTrip (TF's TypeSpec components: here the
    pytree leaves)"""
    per_replica = PerReplica(jnp.array([1.0], jnp.float32))
    tensor_list, treedef = jax.tree.flatten(per_replica)
    reconstructed = jax.tree.unflatten(treedef, tensor_list)
    assert isinstance(reconstructed, PerReplica)
    assert [v.tolist() for v in reconstructed.values] == [v.tolist() for v in per_replica.values]


def test_type_spec_nest():
    """values_test.py: PerReplicaTest.testTypeSpecNest (`nest.map_structure(expand_composites=True)`
    is `jax.tree.map`; the two components have one shape here)"""
    per_replica = PerReplica(jnp.array([[1.0, 2.0], [5.0, 6.0]], jnp.float32))
    result = jax.tree.map(lambda t: t + 10, per_replica)
    assert isinstance(result, PerReplica)
    assert len(result.values) == 2
    assert result.values[0].tolist() == [11.0, 12.0]
    assert result.values[1].tolist() == [15.0, 16.0]


def test_does_not_trigger_function_tracing():
    """values_test.py: PerReplicaTest.testDoesNotTriggerFunctionTracing"""
    traces = []

    @jax.jit
    def f(x):
        traces.append(None)  # Only happens on trace.
        return x

    per_replica = PerReplica(jnp.array([1.0], jnp.float32))
    f(per_replica)  # Trace once.
    assert traces
    del traces[:]
    for _ in range(5):
        vals, treedef = jax.tree.flatten(per_replica)
        per_replica = jax.tree.unflatten(treedef, [v * 2 for v in vals])
        output = f(per_replica)
        assert isinstance(output, PerReplica)
        assert [v.tolist() for v in output.values] == [v.tolist() for v in per_replica.values]
        assert not traces  # `f` is not traced again.


def test_function_can_return_per_replica():
    """values_test.py: PerReplicaTest.testFunctionCanReturnPerReplica"""
    f = jax.jit(lambda x: x)
    x = PerReplica(jnp.array([1.0], jnp.float32))
    y = f(x)
    assert y is not x
    assert isinstance(y, PerReplica)
    assert [v.tolist() for v in y.values] == [v.tolist() for v in x.values]
    assert jax.tree.structure(x) == jax.tree.structure(y)
    assert jax.eval_shape(lambda v: v, x).stacked == jax.eval_shape(lambda v: v, y).stacked


def test_cond_with_values_convertible_to_tensor():
    """values_test.py: PerReplicaTest.testCondWithValuesConvertibleToTensor (numbers stand in for
    TF's strings "a" and "b", which JAX has no type for)"""
    per_replica_1 = PerReplica(jnp.array([1], jnp.int32))
    per_replica_2 = PerReplica(jnp.array([2], jnp.int32))
    condition = jnp.asarray(True)
    result = jax.lax.cond(condition, lambda: per_replica_1, lambda: per_replica_2)
    assert isinstance(result, PerReplica)
    assert len(result.values) == 1
    assert result.values[0].tolist() == 1


# --- multi_worker_mirrored_2x1_cpu ------------------------------------------------------------


def test_two_process(two_process_case):
    """values_test.py on multi_worker_mirrored_2x1_cpu, a real job of two processes (chief and
    worker); the case id names the TF test (see two_process_worker.py)."""
    two_process_case.check()
