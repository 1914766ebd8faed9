"""one_device_strategy_test.py: OneDeviceStrategyTest, on TF's `one_device_strategy` ('/cpu:0')
and `one_device_strategy_gpu` (here '/cpu:1', a device that is not JAX's default).

TF runs each test in eager and graph mode; graph mode is TF plumbing, so each runs once here. The
checks come from strategy_test_lib.py (test_strategy_test_lib.py), as in TF.

Skipped, as TF internals:
- testMakeInputFnIteratorWithDataset, testMakeInputFnIteratorWithCallable, testNumpyDataset:
  TF1 entry points (`make_input_fn_iterator`, `make_one_shot_iterator`, numpy datasets, V1 only).
- testTrainableVariables: tf.Variable synchronization (ON_READ) and `trainable` flags.
- OneDeviceStrategyOnRemoteWorkerTest (both tests): graph-mode Sessions on an in-process remote
  worker (`create_local_cluster`).
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxstrategy
from tf_parity import combinations as c
from tf_parity import test_strategy_test_lib as lib

DISTRIBUTIONS = pytest.mark.parametrize(
    "distribution", [c.one_device_strategy, c.one_device_strategy_gpu], indirect=True, ids=str
)


@DISTRIBUTIONS
def test_minimize_loss(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testMinimizeLoss"""
    lib.check_minimize_loss_eager(distribution)


@DISTRIBUTIONS
def test_replica_id(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testReplicaId"""
    lib.check_replica_id(distribution)


@DISTRIBUTIONS
def test_call_and_merge_exceptions_call(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testCallAndMergeExceptions (the
    exception of the replica function propagates)"""
    lib.check_call_exceptions(distribution)


@DISTRIBUTIONS
def test_call_and_merge_exceptions_merge(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testCallAndMergeExceptions (merge_call).

    Departure: README MirroredStrategy table row `merge_call` (NotImplementedError, on
    OneDeviceStrategy too)."""
    lib.check_merge_exceptions(distribution)


@DISTRIBUTIONS
def test_replicate_dataset(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testReplicateDataset"""
    lib.check_input_fn_iterable(
        distribution,
        lambda: [np.int64(i) for i in range(10)],  # Dataset.range(10)
        [[i] for i in range(10)],
        expected_num_replicas_in_sync=1,
        expected_num_input_pipelines=1,
        expected_input_pipeline_id=0,
    )


@DISTRIBUTIONS
def test_run(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testRun"""
    lib.check_run(distribution)


@DISTRIBUTIONS
@pytest.mark.parametrize(
    "name",
    lib.COLLECTIVES,
    ids=[
        "testAllReduceSum",
        "testAllReduceSumGradients",
        "testAllReduceSumGradientTape",
        "testAllReduceMean",
        "testAllReduceMeanGradients",
        "testAllReduceMeanGradientTape",
    ],
)
def test_all_reduce(distribution, name):
    """one_device_strategy_test.py: OneDeviceStrategyTest.testAllReduce{Sum,Mean}[Gradients,
    GradientTape] (the id names the method)"""
    lib.check_one_device_collectives(distribution, name)


def _first_element(distribution, options):
    dataset = np.arange(100).reshape(-1, distribution.num_replicas_in_sync)  # range(100).batch(n)
    return next(iter(distribution.experimental_distribute_dataset(list(dataset), options=options)))


@DISTRIBUTIONS
def test_prefetch_to_device_dataset(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.test_prefetch_to_device_dataset

    With `experimental_fetch_to_device=True` the element is on the strategy's device (TF compares
    device types; here the device itself)."""
    item = _first_element(distribution, jaxstrategy.InputOptions(experimental_fetch_to_device=True))
    assert item.devices() == {distribution.device}
    assert {d.platform.upper() for d in item.devices()} == {"CPU"}
    assert item.tolist() == [0]


@DISTRIBUTIONS
def test_prefetch_to_host_dataset(distribution):
    """one_device_strategy_test.py: OneDeviceStrategyTest.test_prefetch_to_host_dataset

    With `experimental_fetch_to_device=False` the element stays in host memory (TF: on the host
    CPU; here a numpy array)."""
    item = _first_element(distribution, jaxstrategy.InputOptions(experimental_fetch_to_device=False))
    assert isinstance(item, np.ndarray)
    assert item.tolist() == [0]
