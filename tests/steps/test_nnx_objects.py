"""Flax NNX objects through `put` and `run`: updated in place as under `nnx.jit`, and the errors
where that cannot hold. (The Flax-docs training loop on every strategy is in conformance.py.)"""

from __future__ import annotations

import functools
import re

import flax
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxstrategy
from jaxstrategy import MirroredStrategy, OneDeviceStrategy, RunOptions
from jaxstrategy.testing import assert_tree_on_strategy


@pytest.fixture
def four(cpu_devices):
    return MirroredStrategy(cpu_devices[:4])


def _batch(strategy, size=8, seed=0):
    rng = np.random.default_rng(seed)
    batch = {
        "x": rng.normal(size=(size, 3)).astype(np.float32),
        "y": rng.normal(size=size).astype(np.float32),
    }
    return next(iter(strategy.experimental_distribute_dataset([batch]))), batch


def _own_gradient_step(model, optimizer, batch):
    grads = nnx.grad(lambda m: jnp.mean((m(batch["x"])[:, 0] - batch["y"]) ** 2))(model)
    optimizer.update(model, grads)  # Each replica's own gradient: not all-reduced.


def test_updates_that_differ_between_replicas_are_an_error_and_change_nothing(four):
    model = four.put(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    optimizer = four.put(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    before = np.asarray(model.kernel[...]).copy()
    batch, _ = _batch(four)
    with pytest.raises(ValueError, match=r"^MirroredStrategy\.run\(\): ") as err:
        four.run(_own_gradient_step, args=(model, optimizer, batch))
    message = str(err.value)
    assert "may differ between replicas:\n  args[0].bias\n  args[0].kernel\n" in message
    assert "the objects were left as they were" in message
    assert "all_reduce('mean', grads)" in message
    np.testing.assert_array_equal(np.asarray(model.kernel[...]), before)
    assert int(optimizer.step[...]) == 0


def test_updates_that_differ_between_replicas_of_donated_objects_say_their_state_is_lost(four):
    model = four.put(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    optimizer = four.put(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    batch, _ = _batch(four)
    with pytest.raises(ValueError, match=r"deleted arrays:\n  args\[0\]\.bias\n  args\[0\]\.kernel\n") as err:
        four.run(
            _own_gradient_step, args=(model, optimizer, batch), options=RunOptions(donate_argnums=(0, 1))
        )
    assert "Rebuild their objects, or restore a checkpoint" in str(err.value)
    assert model.kernel.get_raw_value().is_deleted()
    assert int(optimizer.step[...]) == 1, "what was the same on every replica was written back"


def test_only_donated_objects_lose_what_differs_between_replicas(four):
    differing = four.put(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    donated = four.put(nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    differing_before = np.asarray(differing.bias[...]).copy()
    differing_kernel_before = np.asarray(differing.kernel[...]).copy()
    batch, _ = _batch(four)

    def step(differing, donated, batch):
        differing.bias[...] += batch["y"][:1]  # Each replica's own examples: differs.
        differing.kernel[...] += 1.0  # The same everywhere, yet not written back: the step failed.
        donated.bias[...] += jaxstrategy.get_replica_context().all_reduce("mean", batch["y"][:1])
        donated.kernel[...] += batch["y"][:1]  # Differs, and donated.

    with pytest.raises(
        ValueError, match=r"between replicas:\n  args\[0\]\.bias\n  args\[1\]\.kernel\n"
    ) as err:
        four.run(step, args=(differing, donated, batch), options=RunOptions(donate_argnums=1))
    message = str(err.value)
    assert "hold deleted arrays:\n  args[1].kernel\nRebuild their objects" in message
    assert "The donated objects' other Variables took their new values" in message
    assert "objects not donated were left as they were" in message
    np.testing.assert_array_equal(np.asarray(differing.bias[...]), differing_before)
    np.testing.assert_array_equal(np.asarray(differing.kernel[...]), differing_kernel_before)
    assert donated.kernel.get_raw_value().is_deleted()
    assert not donated.bias.get_raw_value().is_deleted()


def test_a_failed_step_says_which_donated_objects_took_their_updates(four):
    differing = four.put(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    donated = four.put(nnx.Linear(3, 1, rngs=nnx.Rngs(1)))
    batch, _ = _batch(four)

    def step(differing, donated, batch):
        differing.bias[...] += batch["y"][:1]  # Differs, not donated.
        donated.bias[...] += 1.0  # The same everywhere, donated.

    with pytest.raises(ValueError, match=r"The donated objects took their other new values") as err:
        four.run(step, args=(differing, donated, batch), options=RunOptions(donate_argnums=1))
    assert "differ between replicas:\n  args[0].bias\n" in str(err.value)
    assert "hold deleted arrays" not in str(err.value)
    assert np.asarray(donated.bias[...]).tolist() == [1.0]


def test_one_device_takes_the_replica_s_own_gradient(strategy_cpu1):
    model = strategy_cpu1.put(nnx.Linear(3, 1, rngs=nnx.Rngs(0)))
    optimizer = strategy_cpu1.put(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
    batch, _ = _batch(strategy_cpu1)
    strategy_cpu1.run(_own_gradient_step, args=(model, optimizer, batch))
    assert int(optimizer.step[...]) == 1
    assert_tree_on_strategy(nnx.state(model), strategy_cpu1)


class _Normalised(nnx.Module):
    def __init__(self, axis_name):
        self.norm = nnx.BatchNorm(3, axis_name=axis_name, momentum=0.5, rngs=nnx.Rngs(0))

    def __call__(self, x):
        return self.norm(x)


def _normalise(model, batch):
    return jnp.sum(model(batch["x"]))


def test_batch_norm_over_the_replica_axis_keeps_the_global_batch_statistics(four):
    _, host = _batch(four)
    expected = _Normalised(axis_name=None)
    nnx.jit(_normalise)(expected, host)
    model = four.put(_Normalised(axis_name="replica"))
    batch, _ = _batch(four)
    four.run(_normalise, args=(model, batch))
    for name in ("mean", "var"):
        np.testing.assert_allclose(
            np.asarray(getattr(model.norm, name)[...]),
            np.asarray(getattr(expected.norm, name)[...]),
            rtol=1e-5,
        )
    assert_tree_on_strategy(nnx.state(model), four)


def test_batch_norm_without_the_replica_axis_is_the_clear_error(four):
    model = four.put(_Normalised(axis_name=None))
    batch, _ = _batch(four)
    with pytest.raises(ValueError, match=r"\n  args\[0\]\.norm\.mean\n  args\[0\]\.norm\.var\n") as err:
        four.run(_normalise, args=(model, batch))
    assert "give nnx.BatchNorm axis_name='replica'" in str(err.value)


class _Growing(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))


def _grow(model):
    model.extra = nnx.Param(jnp.zeros(2))


def test_changing_the_objects_structure_inside_run_is_an_error(four):
    model = four.put(_Growing())
    with pytest.raises(ValueError, match=r"fn changed the structure of its Flax NNX arguments") as err:
        four.run(_grow, args=(model,))
    assert "create them, and set such flags, before calling run" in str(err.value)
    assert not hasattr(model, "extra")


class _Pair(nnx.Module):
    def __init__(self, shared):
        self.shared = shared


def _bump(first, second):
    first.shared.w[...] = first.shared.w[...] + 1
    return second.shared.w[...]


def test_objects_sharing_a_submodule_stay_shared(four):
    shared = _Growing()
    first, second = _Pair(shared), _Pair(shared)
    four.put((first, second))
    seen = four.run(_bump, args=(first, second))
    assert first.shared is second.shared is shared
    assert np.asarray(seen).tolist() == [2.0, 2.0]  # The change through one was seen through the other.
    assert np.asarray(shared.w[...]).tolist() == [2.0, 2.0]


def test_a_step_with_objects_traces_once(four):
    traces = []

    def step(model, batch):
        traces.append(1)
        model.w[...] = model.w[...] + jaxstrategy.get_replica_context().all_reduce("sum", jnp.sum(batch["y"]))

    model = four.put(_Growing())
    for seed in range(3):
        batch, _ = _batch(four, seed=seed)
        four.run(step, args=(model, batch))
    assert len(traces) == 1


def test_put_places_in_place_beside_other_leaves(four):
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    placed = four.put({"model": model, "scale": np.float32(2)})
    assert placed["model"] is model
    assert_tree_on_strategy({"state": nnx.state(model), "scale": placed["scale"]}, four)


def test_static_options_are_refused_with_objects():
    model = OneDeviceStrategy().put(_Growing())
    with pytest.raises(ValueError, match=r"static arguments cannot be combined with Flax NNX objects") as err:
        OneDeviceStrategy().run(
            lambda m, flag: None, args=(model, True), options=RunOptions(static_argnums=1)
        )
    assert "as a string or an enum member" in str(err.value)
    assert "pass the objects' state (nnx.split)" in str(err.value)


def test_donating_an_argument_that_is_no_object_beside_objects_is_a_clear_error():
    strategy = OneDeviceStrategy()
    model = strategy.put(_Growing())
    with pytest.raises(ValueError, match=r"may donate only arguments that are themselves objects") as err:
        strategy.run(
            lambda m, x: x, args=(model, strategy.put(jnp.ones(2))), options=RunOptions(donate_argnums=(0, 1))
        )
    assert "but args[1] is not." in str(err.value)
    assert "Pass each object as an argument of its own" in str(err.value)


def test_a_donation_option_naming_no_argument_is_an_error_with_objects_too():
    strategy = OneDeviceStrategy()
    model = strategy.put(_Growing())
    with pytest.raises(ValueError, match=r"does not pass \(donate_argnums position 3\)"):
        strategy.run(lambda m: None, args=(model,), options=RunOptions(donate_argnums=3))


def test_an_array_held_by_a_donated_variable_and_by_another_one_is_a_clear_error():
    strategy = OneDeviceStrategy()
    model = strategy.put(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    ema = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
    nnx.update(ema, nnx.state(model))  # The same arrays, as an EMA copy is often started.
    with pytest.raises(ValueError, match=r"args\[0\]\.(bias|kernel) is donated") as err:
        strategy.run(lambda m, e: None, args=(model, ema), options=RunOptions(donate_argnums=0))
    assert re.search(r"also held by args\[1\]\.(bias|kernel)\.", str(err.value))
    assert "(jnp.copy)" in str(err.value)
    assert not model.kernel.get_raw_value().is_deleted(), "refused before anything was donated"


class _NetAndAverage(nnx.Module):
    """A network and its moving average, started as the same arrays (a common EMA start)."""

    def __init__(self):
        self.net = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
        self.ema = nnx.Linear(2, 1, rngs=nnx.Rngs(1))
        nnx.update(self.ema, nnx.state(self.net))


def test_two_donated_variables_holding_one_array_are_a_clear_error():
    strategy = OneDeviceStrategy()
    pair = _NetAndAverage()  # Not put: `put` would give each Variable an array of its own.
    with pytest.raises(ValueError, match=r"args\[0\]\.\w+\.(bias|kernel) is donated") as err:
        strategy.run(lambda p: None, args=(pair,), options=RunOptions(donate_argnums=0))
    assert re.search(r"also held by args\[0\]\.\w+\.(bias|kernel)\.", str(err.value))


def test_put_gives_two_variables_holding_one_array_an_array_each_so_they_can_be_donated():
    strategy = OneDeviceStrategy()
    pair = strategy.put(_NetAndAverage())
    assert pair.net.kernel.get_raw_value() is not pair.ema.kernel.get_raw_value()

    def step(pair):
        pair.net.kernel[...] = pair.net.kernel[...] + 1.0

    average = np.asarray(pair.ema.kernel[...])
    strategy.run(step, args=(pair,), options=RunOptions(donate_argnums=0))
    np.testing.assert_array_equal(np.asarray(pair.net.kernel[...]), average + 1.0)
    np.testing.assert_array_equal(np.asarray(pair.ema.kernel[...]), average)


def test_an_array_held_by_a_donated_variable_and_by_an_argument_names_the_argument():
    strategy = OneDeviceStrategy()
    model = strategy.put(nnx.Linear(2, 1, rngs=nnx.Rngs(0)))
    with pytest.raises(ValueError, match=r"args\[0\]\.kernel is donated .* also held by args\[1\]\['w'\]\."):
        strategy.run(
            lambda m, d: None,
            args=(model, {"w": model.kernel.get_raw_value()}),
            options=RunOptions(donate_argnums=0),
        )


class _Named(nnx.Module):
    def __init__(self):
        self.activation = nnx.Variable("relu")  # Static: no array.
        self.tables = nnx.Variable({"big": jnp.ones((64, 64))})  # A pytree the step only reads.
        self.calls = nnx.Variable(jnp.zeros((), jnp.int32))


def test_variables_holding_static_values_or_pytrees_a_step_only_reads_stay_as_they_are():
    strategy = OneDeviceStrategy()  # `put` refuses the string; JAX's default device holds the rest.
    model = _Named()
    table = model.tables.get_raw_value()["big"]

    def count(model):
        model.calls[...] += model.tables.get_raw_value()["big"][0, 0].astype(jnp.int32)

    for _ in range(2):
        strategy.run(count, args=(model,))
    assert int(model.calls[...]) == 2 and model.activation.get_raw_value() == "relu"
    assert model.tables.get_raw_value()["big"] is table, "not returned (a copy) nor written back"


class _Stats(nnx.Module):
    def __init__(self):
        self.stats = nnx.Variable({"count": jnp.zeros(2)})


def _count_in_place(model):
    model.stats.get_raw_value()["count"] = model.stats.get_raw_value()["count"] + 1  # The same dict.


def test_a_variable_s_pytree_changed_in_place_is_written_back(strategy_cpu1):
    model = strategy_cpu1.put(_Stats())
    for _ in range(2):
        strategy_cpu1.run(_count_in_place, args=(model,))
    assert np.asarray(model.stats.get_raw_value()["count"]).tolist() == [2.0, 2.0]


class _WithFrozen(nnx.Module):
    """A linear model and a Variable that no step changes."""

    def __init__(self):
        self.linear = nnx.Linear(3, 1, rngs=nnx.Rngs(0))
        self.frozen = nnx.Variable(jnp.arange(3.0))


def _sgd_step(model, optimizer, batch):
    loss_fn = lambda m: jnp.mean((m.linear(batch["x"] + m.frozen[...])[:, 0] - batch["y"]) ** 2)  # noqa: E731
    grads = nnx.grad(loss_fn)(model)
    optimizer.update(model, jaxstrategy.get_replica_context().all_reduce("mean", grads))


@pytest.mark.parametrize("strategy_name", ["one device", "four replicas"])
def test_donated_objects_train_as_undonated_ones_and_give_up_their_old_arrays(strategy_name, four):
    strategy = OneDeviceStrategy() if strategy_name == "one device" else four
    batch, host = _batch(strategy, size=8)

    def train(options):
        model = strategy.put(_WithFrozen())
        optimizer = strategy.put(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
        first_kernel = model.linear.kernel.get_raw_value()
        for _ in range(3):
            strategy.run(_sgd_step, args=(model, optimizer, batch), options=options)
        return model, first_kernel

    donated, donated_first = train(RunOptions(donate_argnums=(0, 1)))
    kept, kept_first = train(None)
    assert donated_first.is_deleted() and not kept_first.is_deleted()
    # SGD from numpy: each step's gradient is the whole batch's mean (the replicas' average).
    w, b = np.asarray(kept_first), np.zeros(1, np.float32)
    x = host["x"] + np.arange(3.0, dtype=np.float32)
    for _ in range(3):
        error = x @ w + b - host["y"][:, None]
        w, b = w - 0.1 * 2 * x.T @ error / 8, b - 0.1 * 2 * error.mean(0)
    for model in (donated, kept):
        np.testing.assert_allclose(np.asarray(model.linear.kernel[...]), w, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(model.linear.bias[...]), b, rtol=1e-5)
        # Never changed, yet donated: it came back out of the program, and is still usable.
        assert np.asarray(model.frozen[...]).tolist() == [0.0, 1.0, 2.0]


def test_a_module_built_by_init_lands_on_the_strategy(four):
    model = four.init(lambda: nnx.Linear(2, 3, rngs=nnx.Rngs(0)))
    assert isinstance(model, nnx.Linear)
    assert_tree_on_strategy(nnx.state(model), four)


def _add_one(model):
    model.w[...] = model.w[...] + 1


def test_objects_changed_between_steps_are_seen(four):
    model = four.put(_Growing())
    four.run(_add_one, args=(model,))
    model.w = four.put(nnx.Param(jnp.full(2, 10.0)))  # A new Variable, outside run.
    four.run(_add_one, args=(model,))
    assert np.asarray(model.w[...]).tolist() == [11.0, 11.0]
    other = four.put(_Growing())  # Another object of the same structure.
    four.run(_add_one, args=(other,))
    assert np.asarray(other.w[...]).tolist() == [2.0, 2.0]
    assert np.asarray(model.w[...]).tolist() == [11.0, 11.0]


def test_checkpoints_of_objects_restore_into_live_objects_on_any_strategy(tmp_path, four):
    from jaxstrategy import checkpoint

    one = OneDeviceStrategy("/cpu:1")
    model = one.put(nnx.Linear(3, 2, rngs=nnx.Rngs(0)))
    optimizer = one.put(nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param))
    batch, _ = _batch(one)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam mixes Python floats and int32 counts.
        one.run(_own_gradient_step, args=(model, optimizer, batch))
    checkpoint.save(tmp_path, {"model": model, "optimizer": optimizer, "epoch": np.int32(3)})

    fresh = nnx.Linear(3, 2, rngs=nnx.Rngs(1))
    fresh_optimizer = nnx.Optimizer(fresh, optax.adam(1e-2), wrt=nnx.Param)
    restored = checkpoint.restore(
        tmp_path, strategy=four, target={"model": fresh, "optimizer": fresh_optimizer, "epoch": np.int32(0)}
    )
    assert restored["model"] is fresh and restored["optimizer"] is fresh_optimizer
    assert int(restored["epoch"]) == 3
    np.testing.assert_array_equal(np.asarray(fresh.kernel[...]), np.asarray(model.kernel[...]))
    assert int(fresh_optimizer.step[...]) == 1
    assert_tree_on_strategy(nnx.state((fresh, fresh_optimizer)), four)
    # Saved as their state: read without a target, the structure is the state's.
    assert checkpoint.restore(tmp_path)["model"]["kernel"]["value"].shape == (3, 2)
    # A bare model, saved and restored on its own.
    single = tmp_path / "single"
    checkpoint.save(single, model)
    alone = nnx.Linear(3, 2, rngs=nnx.Rngs(2))
    assert checkpoint.restore(single, strategy=four, target=alone) is alone
    np.testing.assert_array_equal(np.asarray(alone.kernel[...]), np.asarray(model.kernel[...]))


def _step_optimizer(model, optimizer):
    optimizer.update(model, nnx.state(model, nnx.Param))


def test_each_new_optimizer_compiles_its_step_without_the_repeated_code_warning(strategy_cpu1):
    # An optimizer's optax transformation is part of its graph definition, so each new one
    # compiles the step again; that is no lambda made per step, and must not warn as one.
    model = strategy_cpu1.put(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    for _ in range(4):
        optimizer = strategy_cpu1.put(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))
        strategy_cpu1.run(_step_optimizer, args=(model, optimizer))
    assert int(optimizer.step[...]) == 1


def test_run_keeps_no_object_alive(strategy_cpu1):
    import gc
    import weakref

    model = strategy_cpu1.put(_Growing())
    strategy_cpu1.run(_add_one, args=(model,))
    weights = weakref.ref(model.w.get_raw_value())
    del model
    gc.collect()
    assert weights() is None, "the arrays of a deleted model are still referenced"


class _NotAPytree(nnx.Module, pytree=False):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(2))
        self.scale = 1.0


def _add_scale(model):
    model.w[...] = model.w[...] + model.scale


def test_objects_that_are_no_pytrees_are_traversed_every_call(strategy_cpu1):
    model = strategy_cpu1.put(_NotAPytree())
    strategy_cpu1.run(_add_scale, args=(model,))
    model.w = strategy_cpu1.put(nnx.Param(jnp.full(2, 10.0)))
    model.scale = 2.0
    strategy_cpu1.run(_add_scale, args=(model,))
    assert np.asarray(model.w[...]).tolist() == [12.0, 12.0]


class _WithBuffer(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.ones(2))
        self.buffer = jnp.zeros(2)  # A plain array attribute, as Flax 0.12 allows.


def _count(model):
    model.buffer = model.buffer + model.w[...]


def test_plain_array_attributes_are_updated_too(four):
    model = four.put(_WithBuffer())
    for _ in range(2):
        four.run(_count, args=(model,))
    assert np.asarray(model.buffer).tolist() == [2.0, 2.0]


def test_a_step_first_compiled_for_arrays_still_updates_objects(strategy_cpu1):
    def bump(model):
        model.w[...] = model.w[...] + 1

    arrays_first = strategy_cpu1.put(_Growing())
    strategy_cpu1.run(lambda state: state, args=(nnx.state(arrays_first),))
    strategy_cpu1.run(bump, args=(nnx.state(arrays_first),))  # Compiled for a pytree of arrays.
    strategy_cpu1.run(bump, args=(arrays_first,))  # Now an object: updated in place.
    assert np.asarray(arrays_first.w[...]).tolist() == [2.0, 2.0]


class _Counter(nnx.Module):
    def __init__(self):
        self.count = nnx.Variable(jnp.zeros(()))

    def __call__(self, step):
        self.count[...] = self.count[...] + step
        return self.count[...]

    def add(self, step):
        return self(step)


def test_an_object_or_its_method_as_fn_is_traced_and_updated(four):
    counter = four.put(_Counter())
    assert [float(four.run(counter, args=(1.0,))) for _ in range(2)] == [1.0, 2.0]
    assert [float(four.run(counter.add, args=(2.0,))) for _ in range(2)] == [4.0, 6.0]
    assert float(counter.count[...]) == 6.0


class _Configured(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(jnp.zeros(2))
        self.config = {"step": 1.0}  # Static, and not hashable.


def _configured_step(model):
    model.w[...] = model.w[...] + model.config["step"]


def test_unhashable_static_attributes_and_callables(strategy_cpu1):
    model = strategy_cpu1.put(_Configured())
    for _ in range(2):
        strategy_cpu1.run(_configured_step, args=(model,))
    assert np.asarray(model.w[...]).tolist() == [2.0, 2.0]


def test_looking_for_objects_asks_nnx_once_per_type(monkeypatch):
    # NNX's own check costs microseconds a node; a state of 200 leaves with a keyword argument
    # (run's slow path) must not pay it for each.
    from jaxstrategy._src.steps import nnx_objects, nnx_traversal

    calls = []
    is_graph_node = nnx.graph.is_graph_node
    monkeypatch.setattr(nnx.graph, "is_graph_node", lambda x: calls.append(type(x)) or is_graph_node(x))
    monkeypatch.setattr(nnx_traversal, "_IS_OBJECT_TYPE", {})
    state = nnx.state([nnx.Linear(2, 2, rngs=nnx.Rngs(i)) for i in range(100)])
    for _ in range(3):
        assert nnx_objects.find_objects(((state,), {"lr": 0.1})) is None
    assert len(calls) == len(set(calls)) < 10


def _scaled_update(model, optimizer, scale):
    optimizer.update(model, jax.tree.map(lambda p: p * scale, nnx.state(model, nnx.Param)))


def test_replaced_optimizers_and_dropped_step_functions_are_freed(strategy_cpu1):
    import gc
    import weakref

    model = strategy_cpu1.put(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    freed = []
    for _ in range(5):
        optimizer = strategy_cpu1.put(nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param))

        step = functools.partial(_scaled_update, scale=np.float32(2.0))  # New each time, then dropped.
        strategy_cpu1.run(step, args=(model, optimizer))
        momentum = jax.tree.leaves(nnx.state(optimizer, nnx.OptState))[0]
        freed.append(weakref.ref(momentum))
        del optimizer, step, momentum
    gc.collect()
    assert [ref() is None for ref in freed] == [True] * 5


def test_updating_objects_under_an_outer_jit_is_nnx_s_trace_error_and_changes_nothing(strategy_cpu1):
    # The write-back skips one of NNX's two trace checks per Variable; the other must still refuse
    # tracers (values of the outer jit) for Variables made outside it.
    layer = strategy_cpu1.put(nnx.Linear(2, 2, rngs=nnx.Rngs(0)))
    bias = np.asarray(layer.bias[...])

    def bump(layer, x):
        layer.bias[...] = layer.bias[...] + x.sum()
        return x

    with pytest.raises(
        flax.errors.TraceContextError, match="Cannot mutate Param from a different trace level"
    ):
        jax.jit(lambda x: strategy_cpu1.run(bump, args=(layer, x)))(jnp.ones(2))
    np.testing.assert_array_equal(layer.bias[...], bias)
    assert not isinstance(layer.bias.get_raw_value(), jax.core.Tracer)


@pytest.mark.parametrize("plain_attributes", [False, True])
def test_only_the_state_a_step_changes_leaves_it_and_is_written_back(four, plain_attributes):
    class Counted(nnx.Module):
        def __init__(self):
            self.linear = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.calls = (
                jnp.zeros((), jnp.int32) if plain_attributes else nnx.Variable(jnp.zeros((), jnp.int32))
            )

    model = four.put(Counted())
    weights_before = jax.tree.leaves(nnx.state(model.linear))
    batch, host = _batch(four)

    def evaluate(model, batch):  # Reads the weights and counts the call: the weights stay as they were.
        if plain_attributes:
            model.calls = model.calls + 1
        else:
            model.calls[...] += 1
        return jaxstrategy.get_replica_context().all_reduce("mean", jnp.mean(model.linear(batch["x"])))

    for _ in range(2):
        mean = four.run(evaluate, args=(model, batch))
    np.testing.assert_allclose(
        float(mean),
        np.mean(host["x"] @ np.asarray(model.linear.kernel[...]) + np.asarray(model.linear.bias[...])),
        rtol=1e-6,
    )
    # The very same arrays: the program neither returned them (an XLA copy each call) nor were they
    # written back.
    assert all(a is b for a, b in zip(jax.tree.leaves(nnx.state(model.linear)), weights_before, strict=True))
    assert int(model.calls if plain_attributes else model.calls[...]) == 2
