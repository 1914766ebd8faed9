"""RunOptions, InputOptions and InputReplicationMode: TensorFlow's fields, validated."""

from __future__ import annotations

import dataclasses

import pytest

from jaxstrategy import InputOptions, InputReplicationMode, RunOptions


def test_input_options_defaults():
    options = InputOptions()
    assert options.experimental_fetch_to_device is True
    assert options.experimental_replication_mode is InputReplicationMode.PER_WORKER
    assert options.experimental_place_dataset_on_device is False
    assert options.experimental_per_replica_buffer_size is None  # The dataset chooses.


def test_input_options_normalise_like_tensorflow():
    options = InputOptions(experimental_fetch_to_device=None, experimental_replication_mode="per_replica")
    assert options.experimental_fetch_to_device is True
    assert options.experimental_replication_mode is InputReplicationMode.PER_REPLICA


def test_options_compare_by_value_and_are_frozen():
    assert InputOptions() == InputOptions(experimental_per_replica_buffer_size=None)
    assert InputOptions() != InputOptions(experimental_per_replica_buffer_size=2)
    assert RunOptions(donate_argnums=1) == RunOptions(donate_argnums=(1,))
    with pytest.raises(dataclasses.FrozenInstanceError):
        InputOptions().experimental_per_replica_buffer_size = 3  # type: ignore[misc]
    assert (
        dataclasses.replace(
            InputOptions(), experimental_per_replica_buffer_size=0
        ).experimental_per_replica_buffer_size
        == 0
    )


def test_unknown_field_is_a_type_error():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        InputOptions(bogus=1)  # type: ignore[call-arg]


@pytest.mark.parametrize("size", [-1, 1.5, True, "2"])
def test_buffer_size_must_be_a_non_negative_int(size):
    with pytest.raises(
        ValueError, match=r"experimental_per_replica_buffer_size=.*expected an int >= 0"
    ) as err:
        InputOptions(experimental_per_replica_buffer_size=size)
    assert "(0 turns prefetching off" in str(err.value)


def test_replication_mode_must_be_known():
    with pytest.raises(
        ValueError, match=r"experimental_replication_mode='PER_HOST'\): expected an InputReplicationMode"
    ):
        InputOptions(experimental_replication_mode="PER_HOST")


def test_fetch_to_device_must_be_a_bool():
    with pytest.raises(
        TypeError, match=r"InputOptions\(experimental_fetch_to_device=1\): expected True, False or None"
    ):
        InputOptions(experimental_fetch_to_device=1)  # type: ignore[arg-type]


def test_place_dataset_on_device_needs_per_replica_without_fetch():
    with pytest.raises(
        ValueError, match=r"needs experimental_replication_mode=InputReplicationMode.PER_REPLICA"
    ):
        InputOptions(experimental_place_dataset_on_device=True)
    options = InputOptions(
        experimental_place_dataset_on_device=True,
        experimental_replication_mode=InputReplicationMode.PER_REPLICA,
        experimental_fetch_to_device=False,
    )
    assert options.experimental_place_dataset_on_device


def test_replication_modes():
    assert [m.value for m in InputReplicationMode] == ["PER_WORKER", "PER_REPLICA"]


def test_run_options_keep_tensorflow_fields():
    options = RunOptions()
    assert options.experimental_enable_dynamic_batch_size is True
    assert options.experimental_bucketizing_dynamic_shape is False
    assert options.experimental_xla_options is None
    assert (options.donate_argnums, options.donate_argnames) == ((), ())


def test_an_argument_cannot_be_both_donated_and_static():
    with pytest.raises(ValueError, match=r"argument\(s\) \[1\] are both donated and static"):
        RunOptions(donate_argnums=(0, 1), static_argnums=1)
    with pytest.raises(ValueError, match=r"argument\(s\) \['state'\] are both donated and static"):
        RunOptions(donate_argnames="state", static_argnames=("state", "mode"))


def test_run_options_normalise_static_arguments():
    options = RunOptions(static_argnums=2, static_argnames=["mode", "mode"])
    assert (options.static_argnums, options.static_argnames) == ((2,), ("mode",))


def test_run_options_normalise_donation():
    options = RunOptions(donate_argnums=[2, 0, 2], donate_argnames="state")
    assert options.donate_argnums == (0, 2)
    assert options.donate_argnames == ("state",)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"donate_argnums": "0"}, TypeError, r"donate_argnums='0'\): expected an int or a sequence of ints"),
        ({"donate_argnums": (True,)}, TypeError, r"expected an int or a sequence of ints"),
        ({"donate_argnums": -1}, ValueError, r"donate_argnums=-1\): positions must be >= 0"),
        ({"donate_argnames": 3}, TypeError, r"donate_argnames=3\): expected a str or a sequence of strs"),
        ({"donate_argnames": ["a", 1]}, TypeError, r"expected a str or a sequence of strs"),
        ({"static_argnums": "1"}, TypeError, r"static_argnums='1'\): expected an int or a sequence of ints"),
        ({"static_argnames": 1}, TypeError, r"static_argnames=1\): expected a str or a sequence of strs"),
        ({"experimental_enable_dynamic_batch_size": "yes"}, TypeError, r"expected True or False"),
    ],
)
def test_run_options_errors(kwargs, error, message):
    with pytest.raises(error, match=message):
        RunOptions(**kwargs)
