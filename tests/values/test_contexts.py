"""Context functions outside and inside scopes, ValueContext and InputContext."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

import jaxstrategy
from jaxstrategy import InputContext, OneDeviceStrategy, ValueContext

SEMANTICS = Path(__file__).resolve().parents[2] / "docs" / "semantics.md"


def test_outside_every_scope():
    assert jaxstrategy.has_strategy() is False
    assert jaxstrategy.in_cross_replica_context() is False
    default = jaxstrategy.get_strategy()
    assert default == OneDeviceStrategy()
    assert jaxstrategy.get_strategy() is default  # One default strategy, so its compiled steps are kept.
    context = jaxstrategy.get_replica_context()
    assert context.strategy is default
    assert context.replica_id_in_sync_group == 0 and isinstance(context.replica_id_in_sync_group, int)
    assert context.num_replicas_in_sync == 1


def test_the_default_strategy_runs():
    assert jaxstrategy.get_strategy().run(lambda x: x * 2, args=(4,)).tolist() == 8


def test_value_context():
    assert ValueContext() == ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1)
    context = ValueContext(1, 2)
    assert (context.replica_id_in_sync_group, context.num_replicas_in_sync) == (1, 2)
    assert not hasattr(context, "__dict__")  # slots, as in TensorFlow


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"replica_id_in_sync_group": 2, "num_replicas_in_sync": 2},
            r"replica_id_in_sync_group=2\): expected an int in \[0, 2\)",
        ),
        ({"num_replicas_in_sync": 0}, r"num_replicas_in_sync=0\): expected an int >= 1"),
    ],
)
def test_value_context_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ValueContext(**kwargs)


def test_input_context_defaults_match_one_device():
    context = InputContext()
    assert (context.num_input_pipelines, context.input_pipeline_id, context.num_replicas_in_sync) == (1, 0, 1)
    assert context.get_per_replica_batch_size(64) == 64
    assert context.get_per_replica_batch_size(63) == 63


def test_input_context_str_names_jaxstrategy_where_tensorflow_names_tf_distribute():
    # docs/semantics.md, row `str(InputContext())`: TensorFlow 2.21 prints
    # 'tf.distribute.InputContext(input pipeline id 0, total: 1)'; the row quotes both.
    assert str(InputContext()) == "jaxstrategy.InputContext(input pipeline id 0, total: 1)"
    assert str(InputContext(2, 1, 4)) == "jaxstrategy.InputContext(input pipeline id 1, total: 2)"
    rows = [
        line for line in SEMANTICS.read_text().splitlines() if line.startswith("| `str(InputContext())` |")
    ]
    assert len(rows) == 1, f"docs/semantics.md has {len(rows)} rows for str(InputContext())"
    _, _, tensorflow, ours, _ = rows[0].split("|")
    assert "`'tf.distribute.InputContext(input pipeline id 0, total: 1)'`" in tensorflow
    assert f"`'{InputContext()}'`" in ours


def test_per_replica_batch_size_must_divide():
    context = InputContext(num_replicas_in_sync=2)
    assert context.get_per_replica_batch_size(64) == 32
    with pytest.raises(ValueError, match=r"`global_batch_size` 63 is not divisible") as err:
        context.get_per_replica_batch_size(63)
    assert "use a multiple of 2" in str(err.value)


@pytest.mark.parametrize("size", [63.0, "64", True])
def test_per_replica_batch_size_needs_an_int(size):
    with pytest.raises(TypeError, match=r"get_per_replica_batch_size\(.*\): expected an int"):
        InputContext().get_per_replica_batch_size(size)


def test_input_context_errors():
    with pytest.raises(ValueError, match=r"InputContext\(input_pipeline_id=1\): expected an int in \[0, 1\)"):
        InputContext(input_pipeline_id=1)
    with pytest.raises(ValueError, match=r"InputContext\(num_input_pipelines=0\): expected an int >= 1"):
        InputContext(num_input_pipelines=0)


def test_experimental_set_strategy_makes_a_strategy_current_until_replaced_or_undone():
    one, other = jaxstrategy.OneDeviceStrategy("/cpu:0"), jaxstrategy.OneDeviceStrategy("/cpu:1")
    try:
        jaxstrategy.experimental_set_strategy(one)
        assert jaxstrategy.get_strategy() is one and jaxstrategy.in_cross_replica_context()
        with one.scope():  # Its scope on top (another's is an error, as in TensorFlow), then back.
            assert jaxstrategy.get_strategy() is one
        with pytest.raises(jaxstrategy.StrategyContextError, match="Mixing different Strategy objects"):
            with other.scope():
                pass
        assert jaxstrategy.get_strategy() is one
        seen = []
        thread = threading.Thread(target=lambda: seen.append(jaxstrategy.has_strategy()))
        thread.start()
        thread.join()
        assert seen == [False]  # A new thread starts outside every scope, as with scope().
        with pytest.raises(RuntimeError, match=r"Must not be called inside .* scope .*inside run"):
            one.run(lambda: jaxstrategy.experimental_set_strategy(None))
        jaxstrategy.experimental_set_strategy(other)  # Replaces the one it set.
        assert jaxstrategy.get_strategy() is other
    finally:
        jaxstrategy.experimental_set_strategy(None)
    assert not jaxstrategy.has_strategy()


def test_experimental_set_strategy_takes_a_strategy_or_none():
    with pytest.raises(TypeError, match=r"expected a jaxstrategy strategy or None; got '/cpu:0'"):
        jaxstrategy.experimental_set_strategy("/cpu:0")
