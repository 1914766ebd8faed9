"""Splitting a step's arguments into constants, donated and kept leaves."""

from __future__ import annotations

import enum

import jax.numpy as jnp
import numpy as np
import pytest

from jaxstrategy import RunOptions
from jaxstrategy._src.steps.argument_roles import ArgumentRoles, has_static_leaves, jit_options

CALLER = "Test.run()"


class Mode(enum.Enum):
    TRAIN = 1


def roles(**options) -> ArgumentRoles:
    return ArgumentRoles.from_options(RunOptions(**options), scalars_are_static=False, caller=CALLER)


def split(role: ArgumentRoles, args, kwargs=None):
    kwargs = kwargs or {}
    return role.split(tuple(args), kwargs, lambda count: [f"sharding{i}" for i in range(count)])


def test_leaves_are_sorted_by_role_and_rebuilt_in_place():
    params, batch = {"w": jnp.ones(2), "b": jnp.zeros(1)}, np.arange(3.0)
    args = (params, batch, Mode.TRAIN)
    kwargs = {"name": "step", "scale": 2.0}
    parts = split(roles(donate_argnums=0, static_argnames="scale"), args, kwargs)
    assert [x.shape for x in parts.donated] == [(1,), (2,)]  # params, in key order: b, w
    assert len(parts.kept) == 1 and parts.kept[0] is batch
    assert [leaf for _, leaf in parts.spec.static] == [Mode.TRAIN, "step", 2.0]
    # Each leaf keeps the sharding given for its position.
    assert parts.donated_shardings == ["sharding0", "sharding1"]
    assert parts.kept_shardings == ["sharding2"]
    rebuilt_args, rebuilt_kwargs = parts.spec.rebuild(parts.donated, parts.kept)
    assert rebuilt_args[0]["w"] is params["w"] and rebuilt_args[1] is batch
    assert rebuilt_args[2] is Mode.TRAIN and rebuilt_kwargs == kwargs


def test_equal_constants_of_different_types_do_not_share_a_spec():
    specs = [split(roles(static_argnums=0), (value,)).spec for value in (1, 1.0, True)]
    assert len(set(specs)) == 3
    assert split(roles(static_argnums=0), (1,)).spec == specs[0]


def test_python_numbers_are_constants_only_where_scalars_are_static():
    traced = ArgumentRoles.from_options(None, scalars_are_static=False, caller=CALLER)
    static = ArgumentRoles.from_options(None, scalars_are_static=True, caller=CALLER)
    assert split(traced, (3,)).kept == [3]
    assert split(static, (3,)).kept == [] and split(static, (3,)).spec.static == ((int, 3),)


def test_unhashable_constants_are_named_by_path():
    with pytest.raises(TypeError, match=r"^Test\.run\(\): compile-time constants .* must be hashable") as err:
        split(
            roles(), ({"config": {"a"}, "lists": ["flattened", "fine"]}, jnp.ones(1)), {"extra": bytearray(1)}
        )
    assert ":\n  args[0]['config'] is a set\n  kwargs['extra'] is a bytearray\n" in str(err.value)
    assert "Pass them as arrays, make them hashable" in str(err.value)


def test_options_naming_arguments_the_call_does_not_pass_are_an_error():
    with pytest.raises(ValueError, match=r"^Test\.run\(\): RunOptions names arguments") as err:
        split(roles(donate_argnums=2, static_argnames="mode"), (jnp.ones(1),))
    assert "(donate_argnums position 2, static_argnames name 'mode')" in str(err.value)
    assert "it passed 1 positional argument(s) and keyword arguments []." in str(err.value)


def test_a_donated_array_passed_twice_is_an_error_naming_both_places():
    x = jnp.ones(2)
    with pytest.raises(ValueError, match=r"the same array is passed as args\[0\] and as args\[1\]\['y'\]"):
        split(roles(donate_argnums=0), (x, {"y": x}))
    with pytest.raises(ValueError, match=r"passed as args\[0\]\[0\] and as args\[0\]\[1\]"):
        split(roles(donate_argnums=0), ((x, x),))
    # Python numbers have no buffer: the same one may be donated and kept.
    parts = split(roles(donate_argnums=0), (1.0, 1.0))
    assert parts.donated == [1.0] and parts.kept == [1.0]


def test_a_structure_called_again_with_arrays_splits_as_the_first_call_did():
    role = roles(donate_argnums=(0, 1))

    def call():
        params, state, batch = {"w": jnp.ones(2), "b": jnp.zeros(1)}, (jnp.ones(3),), jnp.arange(4.0)
        return (params, state, batch), split(role, (params, state, batch))

    _, first = call()
    (params, state, batch), again = call()  # Planned: the leaves gathered by position.
    assert again.spec is first.spec
    assert (
        again.donated[0] is params["b"] and again.donated[1] is params["w"] and again.donated[2] is state[0]
    )
    assert again.kept == [batch] and again.kept_shardings == ["sharding3"]
    assert again.donated_shardings == ["sharding0", "sharding1", "sharding2"]


def test_a_planned_structure_still_refuses_an_array_donated_twice_naming_both_places():
    role = roles(donate_argnums=0)
    split(role, ({"a": jnp.ones(1), "b": jnp.ones(1)}, jnp.ones(1)))  # Plans the structure.
    x = jnp.ones(1)
    with pytest.raises(ValueError, match=r"passed as args\[0\]\['a'\] and as args\[0\]\['b'\]"):
        split(role, ({"a": x, "b": x}, jnp.ones(1)))
    with pytest.raises(ValueError, match=r"passed as args\[0\]\['a'\] and as args\[1\]"):
        split(role, ({"a": x, "b": jnp.ones(1)}, x))


def test_a_planned_structure_with_a_leaf_that_is_no_array_is_split_by_path():
    role = roles(donate_argnums=0)
    split(role, (jnp.ones(1), jnp.ones(1)))
    parts = split(role, (jnp.ones(1), "text"))  # The same structure, a constant where an array was.
    assert parts.kept == [] and parts.spec.static == ((str, "text"),)


def test_jit_options_and_static_leaves():
    assert jit_options(None) == () and not any(jit_options(RunOptions()))
    assert jit_options(RunOptions(donate_argnums=(1, 0)))[0] == (0, 1)
    assert has_static_leaves({"a": jnp.ones(1), "mode": "train"})
    assert not has_static_leaves({"a": jnp.ones(1), "b": np.ones(1), "c": 3.0})
