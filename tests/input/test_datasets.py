"""Distributed datasets on one device: sources, safety, element_spec, warnings and errors."""

from __future__ import annotations

import gc
import threading
import time
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from threads import THREAD_END_TIMEOUT_S, finishes_in_time

import jaxstrategy
from jaxstrategy import InputOptions, MirroredStrategy, OneDeviceStrategy


def _wait_for_prefetch_threads_to_end(before):
    for thread in set(threading.enumerate()) - before:
        if thread.name == "jaxstrategy-prefetch":
            thread.join(timeout=THREAD_END_TIMEOUT_S)
            assert not thread.is_alive(), "a prefetch thread did not end"


# --- sources -----------------------------------------------------------------------------------


def test_spec_example_range_batched(strategy_cpu1):
    batches = np.arange(10).reshape(5, 2)
    dist_dataset = strategy_cpu1.experimental_distribute_dataset(batches)
    out = [x for x in dist_dataset]
    assert [x.tolist() for x in out] == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]]
    assert all(x.devices() == {strategy_cpu1.device} and x.committed for x in out)


def test_partial_last_batch_is_kept_and_structures_are_preserved(strategy_cpu1):
    source = [{"x": np.arange(i, min(i + 2, 9)), "y": (np.float32(i),)} for i in range(0, 9, 2)]
    out = list(strategy_cpu1.experimental_distribute_dataset(source))
    assert out[-1]["x"].tolist() == [8]
    assert jax.tree.structure(out[0]) == jax.tree.structure(source[0])


def test_empty_source_gives_no_steps():
    assert list(OneDeviceStrategy().experimental_distribute_dataset([])) == []


def test_len_and_cardinality_when_the_source_knows():
    dataset = OneDeviceStrategy().experimental_distribute_dataset([np.ones(2)] * 3)
    assert (len(dataset), dataset.cardinality) == (3, 3)


def test_no_len_when_the_source_does_not_know():
    dataset = OneDeviceStrategy().experimental_distribute_dataset(_Reiterable(3))
    assert dataset.cardinality == -2
    with pytest.raises(TypeError, match=r"has no len\(\): how many batches it yields"):
        len(dataset)


class _Reiterable:
    """A source whose __iter__ starts a new pass (like a torch DataLoader), with no len()."""

    def __init__(self, n):
        self.n = n
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return (np.full(2, i, np.float32) for i in range(self.n))


def test_a_reiterable_source_starts_a_fresh_pass_per_iter():
    source = _Reiterable(3)
    dataset = OneDeviceStrategy().experimental_distribute_dataset(source)
    assert [x.tolist() for x in dataset] == [[0, 0], [1, 1], [2, 2]]
    assert [x.tolist() for x in dataset] == [[0, 0], [1, 1], [2, 2]]
    assert source.passes == 2


def test_a_generator_object_allows_one_pass_and_a_second_is_an_error():
    dataset = OneDeviceStrategy().experimental_distribute_dataset(np.ones(2) * i for i in range(3))
    assert len(list(dataset)) == 3
    with pytest.raises(RuntimeError, match=r"one-shot iterator .* used up by its first pass"):
        iter(dataset)


class _FakeTensor:
    """A tensor of another framework: convertible only through .numpy() (like tf.Tensor, torch)."""

    def __init__(self, array):
        self._array = array

    def numpy(self):
        return self._array


class _FakeTfDataset:
    """The two parts of tf.data.Dataset that jaxstrategy uses, without TensorFlow."""

    def as_numpy_iterator(self):
        return iter([{"x": np.zeros(2)}, {"x": np.ones(2)}])

    def cardinality(self):
        return np.int64(2)

    def __iter__(self):
        raise AssertionError("tf.data datasets are read through as_numpy_iterator")


def test_tf_data_like_sources_are_read_as_numpy():
    dataset = OneDeviceStrategy().experimental_distribute_dataset(_FakeTfDataset())
    assert [b["x"].tolist() for b in dataset] == [[0.0, 0.0], [1.0, 1.0]]
    assert len(dataset) == 2


def test_leaves_with_numpy_or_array_methods_are_converted():
    class WithArray:
        def __array__(self, dtype=None, copy=None):
            return np.full(3, 5.0, np.float32)

    source = [(_FakeTensor(np.ones(2, np.int32)), WithArray())]
    ((a, b),) = list(OneDeviceStrategy().experimental_distribute_dataset(source))
    assert (a.tolist(), b.tolist()) == ([1, 1], [5.0, 5.0, 5.0])


def test_non_numeric_leaves_are_an_error_at_their_step():
    source = [{"x": np.ones(2), "name": "ok"}]
    iterator = iter(OneDeviceStrategy().experimental_distribute_dataset(source))
    with pytest.raises(TypeError, match=r"must be a numeric array .* but:\n  batch\['name'\] is a str"):
        next(iterator)


def test_a_dict_dataset_is_an_error_with_a_hint():
    with pytest.raises(TypeError, match=r"the dataset is a dict, whose iteration yields its keys") as err:
        OneDeviceStrategy().experimental_distribute_dataset({"x": np.ones((4, 2))})
    assert "Pass a list of batches" in str(err.value)


def test_host_batches_are_numpy_whatever_the_source_leaves_are():
    options = InputOptions(experimental_fetch_to_device=False)
    source = [{"jax": jnp.ones(2), "int": 3, "numpy": np.zeros(1)}]
    (batch,) = list(OneDeviceStrategy().experimental_distribute_dataset(source, options))
    assert all(isinstance(leaf, np.ndarray) for leaf in batch.values())


def test_a_failed_element_spec_does_not_empty_the_next_pass():
    class FailsOnce:
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            if self.passes == 1:
                raise OSError("flaky storage")
            return iter([np.ones(2)] * 3)

    dataset = OneDeviceStrategy().experimental_distribute_dataset(FailsOnce())
    with pytest.raises(OSError, match="flaky storage"):
        dataset.element_spec  # noqa: B018
    assert len(list(dataset)) == 3


def test_an_empty_dataset_has_no_element_spec():
    with pytest.raises(ValueError, match=r"This distributed dataset is empty") as err:
        OneDeviceStrategy().experimental_distribute_dataset([]).element_spec  # noqa: B018
    assert "InputOptions(partial_batch=" in str(err.value)


def test_a_non_iterable_dataset_is_an_error():
    with pytest.raises(TypeError, match=r"^OneDeviceStrategy\.experimental_distribute_dataset\(\): ") as err:
        OneDeviceStrategy().experimental_distribute_dataset(3)
    assert "the dataset must be an iterable of batches" in str(err.value)
    assert str(err.value).endswith("; got int.")


def test_dataset_fn_errors():
    strategy = OneDeviceStrategy()
    with pytest.raises(TypeError, match=r"dataset_fn must be a function of an InputContext") as err:
        strategy.distribute_datasets_from_function([np.ones(2)])
    assert "got list" in str(err.value)
    with pytest.raises(TypeError, match=r"the dataset must be an iterable of batches .* got NoneType"):
        strategy.distribute_datasets_from_function(lambda context: None)
    with pytest.raises(NotImplementedError, match=r"PER_REPLICA is only supported"):
        strategy.distribute_datasets_from_function(
            lambda c: [], InputOptions(experimental_replication_mode="PER_REPLICA")
        )


def test_options_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"options must be a jaxstrategy.InputOptions; got \{\}"):
        OneDeviceStrategy().experimental_distribute_dataset([], options={})


# --- data already on the devices -------------------------------------------------------------


def test_batches_already_on_the_device_are_delivered_as_they_are(strategy_cpu1):
    placed = strategy_cpu1.put([{"x": np.arange(4.0) + i, "y": np.arange(4) * i} for i in range(3)])
    out = list(strategy_cpu1.experimental_distribute_dataset(placed))
    assert all(o["x"] is p["x"] and o["y"] is p["y"] for o, p in zip(out, placed, strict=True))


def test_jax_leaves_elsewhere_are_moved_to_the_device_beside_numpy_leaves(strategy_cpu1):
    source = [
        {
            "other_device": jax.device_put(jnp.arange(3.0), jax.devices()[0]),
            "uncommitted": jnp.arange(3) * 2,
            "numpy": np.full(3, 7.0, np.float32),
        }
    ]
    (out,) = list(strategy_cpu1.experimental_distribute_dataset(source))
    assert {k: v.tolist() for k, v in out.items()} == {
        "other_device": [0.0, 1.0, 2.0],
        "uncommitted": [0, 2, 4],
        "numpy": [7.0, 7.0, 7.0],
    }
    assert all(leaf.devices() == {strategy_cpu1.device} and leaf.committed for leaf in out.values())


def _donating_step(params, batch):
    # The second output has the batch's shape, so that XLA can take the donated batch's buffer.
    return params + batch["x"].sum(), batch["x"] * 2


def test_a_donated_batch_of_moved_jax_arrays_leaves_the_source_whole():
    strategy = OneDeviceStrategy()  # JAX's default device, where the source's arrays are.
    source = [{"x": jnp.arange(4.0) + i} for i in range(2)]  # Uncommitted: moved, so copied.
    dataset = strategy.experimental_distribute_dataset(source)
    params = strategy.put(jnp.zeros(()))
    options = jaxstrategy.RunOptions(donate_argnums=(0, 1))
    for _ in range(2):  # A second pass reads the same source arrays again.
        for batch in dataset:
            params, _ = strategy.run(_donating_step, args=(params, batch), options=options)
    assert float(params) == 2 * (6.0 + 10.0)
    assert not any(leaf["x"].is_deleted() for leaf in source)


def test_a_donated_batch_delivered_as_it_is_is_a_clear_error_at_the_next_pass(strategy_cpu1):
    dataset = strategy_cpu1.experimental_distribute_dataset(strategy_cpu1.put([{"x": jnp.arange(4.0)}]))
    params = strategy_cpu1.put(jnp.zeros(()))
    options = jaxstrategy.RunOptions(donate_argnums=(0, 1))
    for batch in dataset:
        params, _ = strategy_cpu1.run(_donating_step, args=(params, batch), options=options)
    with pytest.raises(ValueError, match=r"holds an array that was deleted") as err:
        list(dataset)
    assert "donate only the state, not the batch" in str(err.value)


def test_weakly_typed_jax_leaves_are_typed_as_on_every_strategy(strategy_cpu1):
    source = [{"w": jnp.array(0.5), "placed": strategy_cpu1.put(jnp.full(3, 0.5))}]
    assert source[0]["placed"].weak_type
    (batch,) = list(strategy_cpu1.experimental_distribute_dataset(source))
    for leaf in batch.values():
        assert not leaf.weak_type and leaf.dtype == jnp.float32
        assert leaf.devices() == {strategy_cpu1.device} and leaf.committed


def test_typed_key_arrays_are_delivered(strategy_cpu1):
    keys = jax.random.split(jax.random.key(0), 2)
    (batch,) = list(strategy_cpu1.experimental_distribute_dataset([{"keys": keys}]))
    assert jax.numpy.array_equal(jax.random.key_data(batch["keys"]), jax.random.key_data(keys))


def test_a_batch_donated_while_the_next_ones_are_placed_ahead_is_the_clear_error(strategy_cpu1):
    batch = strategy_cpu1.put({"x": jnp.arange(4.0)})
    options = InputOptions(experimental_per_replica_buffer_size=2)  # Placed before the step donates.
    dataset = strategy_cpu1.experimental_distribute_dataset([batch] * 3, options)
    params = strategy_cpu1.put(jnp.zeros(()))
    donate = jaxstrategy.RunOptions(donate_argnums=(0, 1))
    with pytest.raises(ValueError, match=r"holds an array that was deleted") as err:
        for taken in dataset:
            params, _ = strategy_cpu1.run(_donating_step, args=(params, taken), options=donate)
    assert "donate only the state, not the batch" in str(err.value)


@pytest.mark.parametrize("where", ["replicated", "one device"])
def test_mirrored_splits_and_pads_jax_batches_as_it_does_numpy_ones(where):
    strategy = MirroredStrategy(jax.devices()[:2])
    # 5 examples over 2 replicas: padded to 3 each, with a mask; values differ per batch.
    host = [{"x": np.arange(10.0).reshape(5, 2) * (i + 1), "y": np.arange(5) + i} for i in range(3)]
    on_devices = strategy.put(host) if where == "replicated" else jax.device_put(host, jax.devices()[1])
    options = InputOptions(partial_batch="pad")

    def local_results(source):
        batches = strategy.experimental_distribute_dataset(source, options)
        return [jax.tree.map(np.asarray, strategy.experimental_local_results(b)) for b in batches]

    expected, got = local_results(host), local_results(on_devices)
    assert len(got) == 3
    jax.tree.map(np.testing.assert_array_equal, got, expected)
    assert got[0][1][0]["x"].tolist() == [[6.0, 7.0], [8.0, 9.0], [0.0, 0.0]], "replica 1: rows 3, 4, padding"


def test_jax_batches_are_host_arrays_without_fetch_to_device():
    options = InputOptions(experimental_fetch_to_device=False)
    (out,) = list(OneDeviceStrategy().experimental_distribute_dataset([jnp.arange(3)], options))
    assert isinstance(out, np.ndarray) and out.tolist() == [0, 1, 2]


# --- safety ------------------------------------------------------------------------------------


def _refilling_source(n, size=4096):
    """Yields one buffer, refilled for every batch, as a reader with a reused buffer would."""
    buffer = np.empty(size, np.float32)  # Aligned: JAX would alias it on CPU.
    for i in range(n):
        buffer[:] = i
        yield buffer


@pytest.mark.parametrize("buffer_size", [0, 1, 2, 4])
def test_a_source_that_refills_one_buffer_still_yields_correct_batches(buffer_size):
    options = InputOptions(experimental_per_replica_buffer_size=buffer_size)
    dataset = OneDeviceStrategy("/cpu:1").experimental_distribute_dataset(_refilling_source(20), options)
    kept = list(dataset)  # Keep every batch alive while the source keeps writing its buffer.
    assert [float(x[0]) for x in kept] == [float(i) for i in range(20)]
    assert all(float(x.min()) == float(x.max()) for x in kept)


def test_host_batches_are_private_copies_too():
    options = InputOptions(experimental_fetch_to_device=False)
    kept = list(OneDeviceStrategy().experimental_distribute_dataset(_refilling_source(5), options))
    assert [float(x[0]) for x in kept] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_read_only_view_of_a_writeable_buffer_is_copied():
    buffer = np.zeros(4096, np.float32)
    view = buffer.view()
    view.flags.writeable = False  # Read-only, yet its memory changes when buffer is written.
    (batch,) = list(OneDeviceStrategy().experimental_distribute_dataset([view]))
    buffer[:] = 1.0
    assert float(batch.max()) == 0.0


def test_a_source_error_reaches_the_consumer_at_its_step():
    def source():
        yield np.ones(2)
        raise OSError("disk gone")

    iterator = iter(OneDeviceStrategy().experimental_distribute_dataset(source()))
    assert next(iterator).tolist() == [1.0, 1.0]
    with pytest.raises(OSError, match="disk gone"):
        next(iterator)


@pytest.mark.slow  # 2-3 s: over the fast tier's bound (docs/development.md).
def test_a_thousand_abandoned_passes_leave_no_thread_and_no_device_arrays():
    before_threads = set(threading.enumerate())
    dataset = OneDeviceStrategy("/cpu:1").experimental_distribute_dataset(_Reiterable(50))
    list(dataset)  # Warm-up: compiles nothing, but creates JAX's own lasting arrays, if any.
    gc.collect()
    before_arrays = len(jax.live_arrays())
    for _ in range(1000):
        iterator = iter(dataset)
        next(iterator)
        del iterator  # Abandoned mid-pass, as by a `break`.
    gc.collect()
    _wait_for_prefetch_threads_to_end(before_threads)
    gc.collect()
    assert len(jax.live_arrays()) <= before_arrays


def test_at_most_buffer_size_plus_one_batches_are_alive_on_the_device():
    shape = (17, 3)  # A shape nothing else in the process uses.
    options = InputOptions(experimental_per_replica_buffer_size=2)
    source = (np.full(shape, i, np.float32) for i in range(10))
    most = 0
    for batch in OneDeviceStrategy("/cpu:1").experimental_distribute_dataset(source, options):
        time.sleep(0.05)  # A slow step: the producer fills its buffer meanwhile.
        alive = sum(1 for a in jax.live_arrays() if a.shape == shape)
        most = max(most, alive)
        del batch
    assert 2 <= most <= 3, "prefetched ahead, and never more than buffer_size + 1 alive"


def test_shape_changes_mid_stream_warn_once_but_a_partial_last_batch_does_not():
    strategy = OneDeviceStrategy()
    partial_last = [np.ones(4), np.ones(4), np.ones(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        list(strategy.experimental_distribute_dataset(partial_last))
    changing = strategy.experimental_distribute_dataset([np.ones(4), np.ones(5), np.ones(6), np.ones(7)])
    with pytest.warns(UserWarning, match=r"mid-stream \(first: float32\[4\]\)") as record:
        list(changing)
        list(changing)  # Once per dataset, not per pass.
    assert len(record) == 1
    assert "Each new shape compiles" in str(record[0].message)


# --- iterator API ------------------------------------------------------------------------------


def test_element_spec_before_iterating_reuses_the_peeked_pass():
    strategy = OneDeviceStrategy("/cpu:1")
    dataset = strategy.experimental_distribute_dataset({"x": np.ones((2, 3), np.float32)} for _ in range(2))
    spec = dataset.element_spec
    assert spec["x"] == jax.ShapeDtypeStruct((2, 3), jnp.float32, sharding=strategy.sharding)
    assert len(list(dataset)) == 2, "the one-shot source's only pass was kept for the first iter()"


def test_iterator_element_spec_and_context_manager():
    with iter(OneDeviceStrategy().experimental_distribute_dataset([np.zeros((1, 2), np.int32)])) as iterator:
        assert iterator.element_spec.shape == (1, 2) and iterator.element_spec.dtype == jnp.int32
        assert next(iterator).shape == (1, 2)
    with pytest.raises(StopIteration):
        next(iterator)


def test_close_ends_the_thread():
    before = set(threading.enumerate())
    iterator = iter(OneDeviceStrategy().experimental_distribute_dataset(_Reiterable(10**6)))
    next(iterator)
    iterator.close()
    _wait_for_prefetch_threads_to_end(before)


def _starts_a_thread(dataset) -> bool:
    before = set(threading.enumerate())
    iterator = iter(dataset)
    started = any(thread.name == "jaxstrategy-prefetch" for thread in set(threading.enumerate()) - before)
    assert all(leaf.committed for leaf in jax.tree.leaves(next(iterator)))
    iterator.close()
    _wait_for_prefetch_threads_to_end(before)
    return started


@pytest.mark.parametrize(
    "cpu_strategy", [OneDeviceStrategy("/cpu:1"), MirroredStrategy(["/cpu:0", "/cpu:1"])]
)
def test_by_default_cpu_devices_fed_from_memory_place_on_the_calling_thread(cpu_strategy):
    # There a thread would copy while the step computes, on the same cores (bench/vs_keras.py).
    in_memory = [np.ones(2, np.float32)] * 3
    for source in (in_memory, tuple(in_memory), np.ones((3, 2), np.float32)):
        assert not _starts_a_thread(cpu_strategy.experimental_distribute_dataset(source))
    # A source that may wait (on files, the network) keeps its thread, as does an explicit size.
    assert _starts_a_thread(cpu_strategy.experimental_distribute_dataset(_Reiterable(3)))
    double_buffered = InputOptions(experimental_per_replica_buffer_size=2)
    assert _starts_a_thread(cpu_strategy.experimental_distribute_dataset(in_memory, double_buffered))
    assert not _starts_a_thread(
        cpu_strategy.distribute_datasets_from_function(lambda context: [np.ones(3, np.float32)] * 4)
    )


def test_buffer_size_zero_places_on_demand_without_a_thread():
    before = set(threading.enumerate())  # Not a count: threads of other tests may end meanwhile.
    options = InputOptions(experimental_per_replica_buffer_size=0)
    iterator = iter(OneDeviceStrategy().experimental_distribute_dataset([np.ones(2)], options))
    assert set(threading.enumerate()) - before == set()
    assert next(iterator).committed


def test_a_training_loop_over_a_distributed_dataset():
    strategy = OneDeviceStrategy("/cpu:1")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 3)).astype(np.float32)
    y = x @ np.array([1.0, -2.0, 0.5], np.float32)
    batches = [(x[i : i + 16], y[i : i + 16]) for i in range(0, 64, 16)]
    w = strategy.put(np.zeros(3, np.float32))

    def step(w, batch):
        xb, yb = batch
        grad = jax.grad(lambda w: jnp.mean((xb @ w - yb) ** 2))(w)
        return w - 0.1 * grad

    dataset = strategy.experimental_distribute_dataset(batches)
    for _ in range(50):
        for batch in dataset:
            w = strategy.run(step, args=(w, batch))
    np.testing.assert_allclose(w, [1.0, -2.0, 0.5], atol=1e-3)
    assert w.devices() == {strategy.device}
    assert isinstance(dataset, jaxstrategy.DistributedDataset)


def test_a_pass_with_a_huge_buffer_size_ends_and_closes_quickly():
    # Closing once released one semaphore slot per buffer entry: 18 s per pass at 10**7.
    options = InputOptions(experimental_per_replica_buffer_size=10**9)
    dataset = OneDeviceStrategy().experimental_distribute_dataset([np.full(2, i) for i in range(3)], options)
    before = set(threading.enumerate())

    def two_passes():
        assert [x.tolist() for x in dataset] == [[0, 0], [1, 1], [2, 2]]
        with iter(dataset) as iterator:
            next(iterator)

    assert finishes_in_time(two_passes), "a pass with a huge buffer did not end in time"
    _wait_for_prefetch_threads_to_end(before)


@pytest.mark.parametrize("buffer_size", [0, 2])
def test_threads_sharing_one_iterator_each_get_different_batches_and_all_see_the_end(buffer_size):
    options = InputOptions(experimental_per_replica_buffer_size=buffer_size)
    source = (np.full(1, i) for i in range(200))
    iterator = iter(OneDeviceStrategy().experimental_distribute_dataset(source, options))
    taken = [[] for _ in range(4)]
    ended_with: list[BaseException | None] = [None] * 4
    start = threading.Barrier(4)

    def drain(i):
        start.wait()
        try:
            while True:
                taken[i].append(int(iterator.get_next()[0]))
        except BaseException as error:  # noqa: B036  Checked below.
            ended_with[i] = error

    threads = [threading.Thread(target=drain, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(THREAD_END_TIMEOUT_S)
    assert not any(thread.is_alive() for thread in threads), "a consumer thread did not finish"
    assert all(isinstance(error, jaxstrategy.OutOfRangeError) for error in ended_with), ended_with
    assert sorted(x for mine in taken for x in mine) == list(range(200)), "every batch exactly once"
