"""input_lib_test.py: distributed datasets and iterators, on TF's one-device and mirrored stand-ins
(combinations.py) and on `multi_worker_mirrored_2x1_cpu` (a real job of two processes, cases in
two_process_worker.py).

Python lists and generators stand in for tf.data. TF's `input_type="input_fn"` is
`distribute_datasets_from_function`. TF's `input_type="dataset"` wraps the dataset in its internal
`DistributedDataset`, without rebatching unless the test passes `num_replicas_in_sync`: consecutive
elements go to consecutive replicas. The public `experimental_distribute_dataset` always splits
each global batch over the replicas, so where TF's dataset has one element per replica and step,
its translation batches those elements (range(10) over two replicas becomes range(10).batch(2),
each replica then holding a one-element batch). `iteration_type` ("get_next", "for_loop") is kept;
TF's `enable_get_next_as_optional` is a private switch of how its iterator pads partial batches and
is not a parameter here.

Skipped, as TF internals:
- api_type="wrap_into_iterator" variants: TF's private `input_lib.DatasetIterator` class.
- testDisablingOwnedIteratorsInTF2, testMultiDeviceIterInitialize: TF's private iterator classes
  and V1 iterators.
- testTPU: TPU only.
- testTupleDatasetMultiworker, testUnevenDatasetBatchesMultiWorkerFourReplicas,
  testBatchSplittingMultiWorker: multi_worker_mirrored_2x2_gpu only (two GPUs per worker).
- testOneDeviceCPUMultiWorker[dataset]: TF's internal DistributedDataset over one local device
  without rebatching or sharding; no public call does that on a job of two processes.
- testAutoshardingOption, testMWMSPartialBatch, testMWMSPartialBatchWithLegacyRebatch,
  testMWMSWithDataSharding: tf.data's AutoShardPolicy and rebatching rewrites; jaxstrategy never
  shards or rebatches a source (experimental_distribute_dataset splits each global batch, and
  distribute_datasets_from_function leaves sharding to the dataset function).
- DistributedIteratorTensorTypeTest (testRaggedSparse, testRaggedSparseGetNextAsOptional,
  testRaggedSparseGetNextAsOptionalInLoop): RaggedTensor and SparseTensor, which JAX has no
  counterpart of.
- DistributedIteratorTfDataServiceTest: the tf.data service.
- The GPU, TPU and central-storage combinations (their one- and two-device behaviour runs on the
  CPU stand-ins).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jaxstrategy
from jaxstrategy import InputOptions, InputReplicationMode
from tf_parity import combinations as c
from tf_parity.test_strategy_test_lib import local
from tf_parity.two_process_worker import ShuffledRange

TF_FILE = "input_lib_test.py"
ONE_DEVICE = pytest.mark.parametrize(
    "distribution", [c.one_device_strategy, c.mirrored_strategy_with_one_cpu], indirect=True, ids=str
)
TWO_DEVICES = pytest.mark.parametrize(
    "distribution", [c.mirrored_strategy_with_gpu_and_cpu], indirect=True, ids=str
)
SINGLE_WORKER = pytest.mark.parametrize(
    "distribution",
    [c.one_device_strategy, c.mirrored_strategy_with_one_cpu, c.mirrored_strategy_with_gpu_and_cpu],
    indirect=True,
    ids=str,
)
ITERATION_TYPE = pytest.mark.parametrize("iteration_type", ["get_next", "for_loop"])
INPUT_TYPE = pytest.mark.parametrize("input_type", ["input_fn", "dataset"])


def _values(strategy, element):
    return local(strategy, element)


def check_input_iteration(strategy, dataset, expected_values, iteration_type):
    """input_lib_test.py: DistributedIteratorTestBase._test_input_iteration (wrap_into_dataset).

    get_next: the expected values, then OutOfRangeError; a new `iter()` gives them again; then
    `get_next_as_optional()` gives them as optionals, then one without a value, whose
    `get_value()` raises (TF: InvalidArgumentError; here ValueError). for_loop: the values."""
    if iteration_type == "for_loop":
        assert [_values(strategy, x) for x in dataset] == expected_values
        return
    with iter(dataset) as iterator:
        assert [_values(strategy, iterator.get_next()) for _ in expected_values] == expected_values
        with pytest.raises(jaxstrategy.OutOfRangeError):
            iterator.get_next()
    with iter(dataset) as iterator:  # After re-initializing the iterator, it iterates again.
        assert [_values(strategy, iterator.get_next()) for _ in expected_values] == expected_values
    with iter(dataset) as iterator:
        optionals = [iterator.get_next_as_optional() for _ in expected_values]
        assert [_values(strategy, o.get_value()) for o in optionals] == expected_values
        next_element = iterator.get_next_as_optional()
        assert not next_element.has_value()
        with pytest.raises(ValueError, match=r"has no value"):
            iterator.get_next_as_optional().get_value()


def _distribute(strategy, input_type, elements, dataset_batches):
    """input_fn: the elements, through distribute_datasets_from_function; dataset: the global
    batches, through experimental_distribute_dataset."""
    if input_type == "input_fn":
        return strategy.distribute_datasets_from_function(lambda _: elements)
    return strategy.experimental_distribute_dataset(dataset_batches)


# --- DistributedIteratorTest ------------------------------------------------------------------


@ONE_DEVICE
@INPUT_TYPE
@ITERATION_TYPE
def test_one_device_cpu(distribution, input_type, iteration_type):
    """input_lib_test.py: DistributedIteratorTest.testOneDeviceCPU (Dataset.range(10), one
    replica: each element as it is)"""
    elements = [np.int64(i) for i in range(10)]
    dataset = _distribute(distribution, input_type, elements, elements)
    check_input_iteration(distribution, dataset, [[i] for i in range(10)], iteration_type)


@TWO_DEVICES
@INPUT_TYPE
@ITERATION_TYPE
def test_two_devices_one_gpu_one_cpu(distribution, input_type, iteration_type):
    """input_lib_test.py: DistributedIteratorTest.testTwoDevicesOneGPUOneCPU (Dataset.range(10):
    consecutive elements to the two replicas; the dataset variant batches them in pairs)"""
    elements = [np.int64(i) for i in range(10)]
    pairs = [np.arange(i, i + 2) for i in range(0, 10, 2)]
    dataset = _distribute(distribution, input_type, elements, pairs)
    if input_type == "input_fn":
        expected = [[i, i + 1] for i in range(0, 10, 2)]
    else:
        expected = [[[i], [i + 1]] for i in range(0, 10, 2)]
    check_input_iteration(distribution, dataset, expected, iteration_type)


@TWO_DEVICES
@INPUT_TYPE
@ITERATION_TYPE
def test_tuple_dataset(distribution, input_type, iteration_type):
    """input_lib_test.py: DistributedIteratorTest.testTupleDataset (zip(range(10), range(10) ** 2))"""
    elements = [(np.int64(i), np.int64(i**2)) for i in range(10)]
    pairs = [(np.arange(i, i + 2), np.arange(i, i + 2) ** 2) for i in range(0, 10, 2)]
    dataset = _distribute(distribution, input_type, elements, pairs)
    if input_type == "input_fn":
        expected = [[(i, i**2), (i + 1, (i + 1) ** 2)] for i in range(0, 10, 2)]
    else:
        expected = [[([i], [i**2]), ([i + 1], [(i + 1) ** 2])] for i in range(0, 10, 2)]
    check_input_iteration(distribution, dataset, expected, iteration_type)


@ONE_DEVICE
def test_iterable_iterator(distribution):
    """input_lib_test.py: DistributedIteratorTest.testIterableIterator (the iterator is itself
    iterable)"""
    dist_dataset = distribution.experimental_distribute_dataset([np.int64(i) for i in range(10)])
    iterator = iter(dist_dataset)
    for i, element in enumerate(iterator):
        assert _values(distribution, element) == [i]
    assert i == 9


@pytest.mark.parametrize(
    "distribution",
    [c.mirrored_strategy_with_cpu_1_and_2, c.mirrored_strategy_with_one_cpu],
    indirect=True,
    ids=str,
)
def test_iterable_iterator_error(distribution):
    """input_lib_test.py: DistributedIteratorTest.testIterableIteratorError

    `next(iterator)` inside the replica function is a ValueError (the iterator passed as an
    argument, as TF does, and the iterator closed over); `run` takes `next(iterator)` instead."""
    dataset = [np.arange(i, i + 2) for i in range(0, 10, 2)]  # range(10).batch(2)
    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    iterator = iter(dist_dataset)

    def replica_fn1(iterator):
        return next(iterator)

    with pytest.raises(ValueError):
        distribution.run(replica_fn1, args=(iterator,))
    with pytest.raises(ValueError, match=r"next\(iterator\) should be called outside"):
        distribution.run(lambda: next(iterator))

    if distribution.num_replicas_in_sync == 1:
        expected_result = [[[i, i + 1]] for i in range(0, 10, 2)]
    else:
        expected_result = [[[i], [i + 1]] for i in range(0, 10, 2)]

    with distribution.scope():
        result = distribution.run(lambda x: x, args=(next(iterator),))
        assert _values(distribution, result) == expected_result[0]

    # The default replica context works too.
    iterator = iter(dist_dataset)
    for i, element in enumerate(iterator):
        assert _values(distribution, element) == expected_result[i]


@TWO_DEVICES
@INPUT_TYPE
@ITERATION_TYPE
def test_uneven_dataset_batches_drop_remainder(distribution, input_type, iteration_type):
    """input_lib_test.py: DistributedIteratorTest.testUnevenDatasetBatches[drop_remainder=True]
    (range(9).batch(2, drop_remainder=True): whole batches to consecutive replicas; the dataset
    variant gets the global batches of four that the replicas' pairs make)"""
    pairs = [np.arange(i, i + 2) for i in range(0, 8, 2)]
    fours = [np.arange(i, i + 4) for i in range(0, 8, 4)]
    dataset = _distribute(distribution, input_type, pairs, fours)
    check_input_iteration(distribution, dataset, [[[0, 1], [2, 3]], [[4, 5], [6, 7]]], iteration_type)


@TWO_DEVICES
@INPUT_TYPE
def test_uneven_dataset_batches_keep_remainder(distribution, input_type):
    """input_lib_test.py: DistributedIteratorTest.testUnevenDatasetBatches[drop_remainder=False]

    TF's last step gives replica 0 [8] and replica 1 an empty batch. Departure: README
    MirroredStrategy table rows "a global batch the replicas do not divide" (experimental_
    distribute_dataset) and "distribute_datasets_from_function with elements left over for fewer
    than all replicas": an error by default, naming the choices (partial_batch 'drop' or 'pad')."""
    pairs = [np.arange(i, min(i + 2, 9)) for i in range(0, 9, 2)]
    fours = [np.arange(i, min(i + 4, 9)) for i in range(0, 9, 4)]
    dataset = _distribute(distribution, input_type, pairs, fours)
    seen = []
    with pytest.raises(ValueError, match=r"partial_batch='drop'"):
        for x in dataset:
            seen.append(_values(distribution, x))
    assert seen == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]


@TWO_DEVICES
@ITERATION_TYPE
@pytest.mark.parametrize(
    "num_replicas_in_sync", [None, 2], ids=["num_replicas_in_sync=None", "num_replicas_in_sync=2"]
)
def test_batch_splitting(distribution, iteration_type, num_replicas_in_sync):
    """input_lib_test.py: DistributedIteratorTest.testBatchSplitting (range(100).batch(10))

    Told the number of replicas, TF splits each batch of 10 into two of 5: the public
    experimental_distribute_dataset. Without it, whole batches go to consecutive replicas: the
    public distribute_datasets_from_function."""
    batch_size = 10
    batches = [np.arange(i, i + batch_size) for i in range(0, 100, batch_size)]
    if num_replicas_in_sync:
        dataset = distribution.experimental_distribute_dataset(batches)
    else:
        dataset = distribution.distribute_datasets_from_function(lambda _: batches)
    updated_batch_size = batch_size // num_replicas_in_sync if num_replicas_in_sync else batch_size
    expected_values = [
        [
            list(range(i, i + updated_batch_size)),
            list(range(i + updated_batch_size, i + 2 * updated_batch_size)),
        ]
        for i in range(0, 100, updated_batch_size * 2)
    ]
    check_input_iteration(distribution, dataset, expected_values, iteration_type)


@SINGLE_WORKER
def test_cache_across_iteration(distribution):
    """input_lib_test.py: DistributedIteratorTest.testCacheAcrossIteration

    Dataset.range(16).shuffle(16).cache().batch(4): a source shuffled once gives the same epochs."""
    cached = np.random.default_rng(7).permutation(16).reshape(4, 4)
    dist_dataset = distribution.experimental_distribute_dataset(list(cached))
    first_epoch = [_values(distribution, x) for x in dist_dataset]
    second_epoch = [_values(distribution, x) for x in dist_dataset]
    assert first_epoch == second_epoch
    assert sorted(np.ravel(first_epoch).tolist()) == list(range(16))


@SINGLE_WORKER
@pytest.mark.parametrize("reshuffle", [True, False], ids=["reshuffle=True", "reshuffle=False"])
def test_shuffle_across_iterations(distribution, reshuffle):
    """input_lib_test.py: DistributedIteratorTest.testShuffleAcrossIterations

    Dataset.range(12).shuffle(12, reshuffle_each_iteration).batch(4): each `for` starts a new pass
    over the source, so a source that reshuffles per pass gives different epochs, and one that
    does not gives the same."""
    dist_dataset = distribution.experimental_distribute_dataset(ShuffledRange(12, 4, reshuffle))
    first_epoch = [_values(distribution, x) for x in dist_dataset]
    second_epoch = [_values(distribution, x) for x in dist_dataset]
    assert (first_epoch != second_epoch) == reshuffle


@SINGLE_WORKER
def test_get_next_optional_shape(distribution):
    """input_lib_test.py: DistributedIteratorTest.testGetNextOptionalShape (static per-replica shapes)"""
    batch_size = 8
    dataset = [{"feature": np.ones([batch_size, 10], np.float32), "label": np.ones([batch_size], np.float32)}]
    dist_dataset = distribution.experimental_distribute_dataset(dataset)
    per_replica_batch_size = batch_size // distribution.num_replicas_in_sync
    steps = 0
    for data in dist_dataset:
        data = jax.tree.map(
            distribution.experimental_local_results,
            data,
            is_leaf=lambda x: isinstance(x, jaxstrategy.PerReplica),
        )
        feature, label = data["feature"], data["label"]
        for replica_id in range(len(distribution.extended.worker_devices)):
            assert feature[replica_id].shape == (per_replica_batch_size, 10)
            assert label[replica_id].shape == (per_replica_batch_size,)
        steps += 1
    assert steps == 1


# --- DistributedIteratorPerDeviceTest ---------------------------------------------------------

PER_DEVICE = pytest.mark.parametrize(
    "distribution", [c.mirrored_strategy_with_cpu_1_and_2], indirect=True, ids=str
)


def _deprecated_distribute_datasets_from_function(distribution, dataset_fn, input_options):
    """TF's tests call the deprecated `experimental_distribute_datasets_from_function`; so do
    these, which warns (DeprecationWarning), as TF's does (in its log)."""
    with pytest.warns(DeprecationWarning, match=r"call distribute_datasets_from_function\(\) instead"):
        return distribution.experimental_distribute_datasets_from_function(dataset_fn, input_options)


@PER_DEVICE
@pytest.mark.parametrize("mode", [InputReplicationMode.PER_WORKER, InputReplicationMode.PER_REPLICA], ids=str)
def test_device_placement_for_per_worker_values_with_prefetch(distribution, mode):
    """input_lib_test.py: DistributedIteratorPerDeviceTest.testDevicePlacementForPerWorkerValuesWithPrefetch"""
    input_options = InputOptions(
        experimental_place_dataset_on_device=False,
        experimental_fetch_to_device=True,
        experimental_replication_mode=mode,
    )
    ds = _deprecated_distribute_datasets_from_function(
        distribution, lambda input_context: [np.int32(v) for v in [1, 2, 3, 4]], input_options
    )
    steps = 0
    for x in ds:
        assert [v.devices() for v in x.values] == [{d} for d in distribution.devices]
        steps += 1
    assert steps == (2 if mode is InputReplicationMode.PER_WORKER else 4)


@PER_DEVICE
def test_device_placement_for_per_worker_values_without_prefetch(distribution):
    """input_lib_test.py: DistributedIteratorPerDeviceTest.testDevicePlacementForPerWorkerValuesWithoutPrefetch

    Departure: README, MirroredStrategy's table, "host elements passed to `run`". TF's identity
    step leaves host (fetch_to_device=False) elements on the host CPU:0; `run` here places every
    input on its replica's device, so the outputs are there.
    """
    input_options = InputOptions(
        experimental_place_dataset_on_device=False,
        experimental_fetch_to_device=False,
        experimental_replication_mode=InputReplicationMode.PER_WORKER,
    )
    ds = _deprecated_distribute_datasets_from_function(
        distribution, lambda input_context: list(np.full(4, input_context.input_pipeline_id)), input_options
    )
    steps = 0
    for x in ds:
        assert not any(isinstance(v, jax.Array) for v in x.values)  # On the host, as in TF.
        x = distribution.run(lambda inputs: inputs, args=(x,))
        assert [v.devices() for v in x.values] == [{d} for d in distribution.devices]
        steps += 1
    assert steps == 2


@PER_DEVICE
@pytest.mark.parametrize(
    ("fetch_to_device", "mode"),
    [(False, InputReplicationMode.PER_WORKER), (True, InputReplicationMode.PER_REPLICA)],
    ids=["fetch_to_device=False-PER_WORKER", "fetch_to_device=True-PER_REPLICA"],
)
def test_device_placement_for_invalid_combinations(distribution, fetch_to_device, mode):
    """input_lib_test.py: DistributedIteratorPerDeviceTest.testDevicePlacementForInvalidCombinations
    (experimental_place_dataset_on_device=True needs PER_REPLICA without fetch_to_device; here the
    ValueError comes from InputOptions itself, before the call)"""
    with pytest.raises(ValueError, match=r"experimental_place_dataset_on_device=True\) needs"):
        input_options = InputOptions(
            experimental_place_dataset_on_device=True,
            experimental_fetch_to_device=fetch_to_device,
            experimental_replication_mode=mode,
        )
        distribution.distribute_datasets_from_function(
            lambda input_context: list(np.full(4, input_context.input_pipeline_id)), input_options
        )


def _one_to_ten(input_context):
    return list(np.arange(1, 11).reshape((2, 5)) * (input_context.input_pipeline_id + 1))


@PER_DEVICE
@pytest.mark.parametrize(
    "fetch_to_device", [False, True], ids=["fetch_to_device=False", "fetch_to_device=True"]
)
def test_prefetch_buffer_size_input_options(distribution, fetch_to_device):
    """input_lib_test.py: DistributedIteratorPerDeviceTest.testPrefetchBufferSizeInputOptions"""
    input_options = InputOptions(
        experimental_place_dataset_on_device=False,
        experimental_fetch_to_device=fetch_to_device,
        experimental_per_replica_buffer_size=2,
    )
    ds = _deprecated_distribute_datasets_from_function(distribution, _one_to_ten, input_options)
    x = next(iter(ds))
    assert np.asarray(x.values[0]).tolist() == [1, 2, 3, 4, 5]
    assert np.asarray(x.values[1]).tolist() == [6, 7, 8, 9, 10]


@PER_DEVICE
@pytest.mark.parametrize(
    "fetch_to_device", [False, True], ids=["fetch_to_device=False", "fetch_to_device=True"]
)
def test_output_values_for_per_worker_input_options(distribution, fetch_to_device):
    """input_lib_test.py: DistributedIteratorPerDeviceTest.testOutputValuesForPerWorkerInputOptions"""
    input_options = InputOptions(
        experimental_place_dataset_on_device=False,
        experimental_fetch_to_device=fetch_to_device,
        experimental_replication_mode=InputReplicationMode.PER_WORKER,
    )
    ds = _deprecated_distribute_datasets_from_function(distribution, _one_to_ten, input_options)
    x = next(iter(ds))
    assert np.asarray(x.values[0]).tolist() == [1, 2, 3, 4, 5]
    assert np.asarray(x.values[1]).tolist() == [6, 7, 8, 9, 10]


@PER_DEVICE
@pytest.mark.parametrize(
    ("place_dataset_on_device", "fetch_to_device"),
    [(True, False), (False, False), (False, True)],
    ids=["place_on_device-no_fetch", "no_place-no_fetch", "no_place-fetch"],
)
def test_output_values_for_per_replica_input_options(distribution, place_dataset_on_device, fetch_to_device):
    """input_lib_test.py: DistributedIteratorPerDeviceTest.testOutputValuesForPerReplicaInputOptions
    (one pipeline per replica: replica i reads pipeline i's elements)"""
    input_options = InputOptions(
        experimental_place_dataset_on_device=place_dataset_on_device,
        experimental_fetch_to_device=fetch_to_device,
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
    )
    ds = _deprecated_distribute_datasets_from_function(
        distribution,
        lambda input_context: list(np.arange(1, 10) * (input_context.input_pipeline_id + 1)),
        input_options,
    )
    expected = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9])
    loop_num = -1
    for i, x in enumerate(ds):
        assert np.asarray(x.values[0]).tolist() == expected[i]
        assert np.asarray(x.values[1]).tolist() == expected[i] * 2
        loop_num = i
    assert loop_num == len(expected) - 1


# --- multi_worker_mirrored_2x1_cpu ------------------------------------------------------------


def test_two_process(two_process_case):
    """input_lib_test.py on multi_worker_mirrored_2x1_cpu, a real job of two processes (chief and
    worker); the case id names the TF test (see two_process_worker.py)."""
    two_process_case.check()
