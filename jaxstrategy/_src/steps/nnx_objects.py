"""Flax NNX objects (a Module, an Optimizer, `nnx.Rngs`) as arguments of `put`, `run` and checkpoints.

As Flax's own loop does, `run` updates the objects passed to it in place: it finds them among the
arguments, runs `fn` on their state, and writes the new values back into their Variables, unless
those may differ between replicas (an error naming them). `put` places their state, and a
checkpoint holds it (`with_states`). docs/internals.md, "Running a step", tells how and why.
"""

from __future__ import annotations

import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax

from jaxstrategy._src.core.errors import bullet_list, format_argument_path
from jaxstrategy._src.core.tree_checks import has_wide_host_leaf, require_named_representable
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.steps.argument_roles import ArgumentRoles
from jaxstrategy._src.steps.nnx_step import ObjectSlots, step_with_objects
from jaxstrategy._src.steps.nnx_traversal import Traversal, is_nnx_object, loaded_nnx, traverse

# The questions `run` and `put` ask of any value, answered there by type.
from jaxstrategy._src.steps.nnx_traversal import any_object_among as any_object_among
from jaxstrategy._src.steps.nnx_traversal import is_object as is_object
from jaxstrategy._src.steps.nnx_traversal import is_variable as is_variable
from jaxstrategy._src.values.options import RunOptions
from jaxstrategy._src.values.per_replica import PerReplica


def callee_as_argument(
    fn: Callable[..., PyTree], args: tuple[Any, ...]
) -> tuple[Callable[..., PyTree], tuple[Any, ...]]:
    """`fn` and `args`, with an object called as `fn` (a Module, or its bound method) made the first
    argument, so that its Variables are traced and updated rather than baked into the program."""
    if loaded_nnx() is None:
        return fn, args
    if type(fn) is types.MethodType and is_nnx_object(fn.__self__):
        return _method_caller(fn.__func__), (fn.__self__, *args)
    if is_nnx_object(fn):
        return _call_object, (fn, *args)
    return fn, args


def _call_object(obj: Any, *args: Any, **kwargs: Any) -> PyTree:
    return obj(*args, **kwargs)


_METHOD_CALLERS: weakref.WeakKeyDictionary[Callable[..., Any], Callable[..., PyTree]] = (
    weakref.WeakKeyDictionary()
)


def _method_caller(function: Callable[..., PyTree]) -> Callable[..., PyTree]:
    """One caller per method, so that `run` compiles `obj.method` once, whatever `obj`."""
    caller = _METHOD_CALLERS.get(function)
    if caller is None:
        resolve = weakref.ref(function)

        def call_method(obj: Any, *args: Any, **kwargs: Any) -> PyTree:
            return resolve()(obj, *args, **kwargs)  # type: ignore[misc]

        call_method.__name__ = call_method.__qualname__ = getattr(function, "__name__", "method")
        caller = _METHOD_CALLERS[function] = call_method
    return caller


@dataclasses.dataclass(frozen=True)
class ObjectsInTree:
    """The NNX objects found among the leaves of a tree, and where they sit: the tree's other
    leaves, the slots that the objects fill among them, and the objects' key paths."""

    objects: tuple[Any, ...]
    other_leaves: list[Any]
    slots: ObjectSlots
    object_paths: list[Any]


def find_objects(tree: PyTree) -> ObjectsInTree | None:
    """The NNX objects in `tree` and the rest of it, or None when it holds none."""
    if loaded_nnx() is None:  # No program passes NNX objects without having imported flax.nnx.
        return None
    # A PerReplica stays whole: `run` gives each replica its component.
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, PerReplica) or is_nnx_object(x)
    )
    positions = tuple(i for i, (_, leaf) in enumerate(path_leaves) if is_nnx_object(leaf))
    if not positions:
        return None
    return ObjectsInTree(
        objects=tuple(path_leaves[i][1] for i in positions),
        other_leaves=[leaf for i, (_, leaf) in enumerate(path_leaves) if i not in positions],
        slots=ObjectSlots(treedef, positions),
        object_paths=[path_leaves[i][0] for i in positions],
    )


def put_objects(found: ObjectsInTree, place: Callable[[PyTree], PyTree]) -> PyTree:
    """Place the state of the objects `found` in a tree, and its other leaves, with `place`; the
    objects are updated in place and the tree comes back holding the same objects."""
    nnx = loaded_nnx()
    state, placed_others = place((nnx.state(found.objects), found.other_leaves))
    nnx.update(found.objects, state)
    return found.slots.fill(found.objects, placed_others)


def donated_objects(
    found: ObjectsInTree, args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions, caller: str
) -> frozenset[int]:
    """The positions in `found.objects` of the objects that `options` donates: the arguments it
    names, each of which must be an object (its Variables' arrays are donated).

    Raises:
      ValueError: an option names an argument this call does not pass, or a donated argument is
        not itself an NNX object.
    """
    roles = ArgumentRoles.from_options(options, scalars_are_static=False, caller=caller)
    roles.check_named_arguments_exist(args, kwargs)
    named = [(f"args[{i}]", args[i]) for i in roles.donate_argnums]
    named += [(f"kwargs[{name!r}]", kwargs[name]) for name in roles.donate_argnames]
    others = [name for name, value in named if not is_nnx_object(value)]
    if others:
        raise ValueError(
            f"{caller}: with Flax NNX objects among the arguments, RunOptions may donate only "
            f"arguments that are themselves objects (their Variables' arrays are donated), but "
            f"{', '.join(others)} {'is' if len(others) == 1 else 'are'} not. Pass each object as "
            "an argument of its own and donate those, or pass their state (nnx.split) and the "
            "rest as pytrees."
        )
    donated_ids = {id(value) for _, value in named}
    return frozenset(i for i, obj in enumerate(found.objects) if id(obj) in donated_ids)


# How `run_with_objects` donates: the first argument of its step holds the donated state leaves.
_DONATE_FIRST = RunOptions(donate_argnums=0)


def run_with_objects(
    run: Callable[..., PyTree],
    fn: Callable[..., PyTree],
    found: ObjectsInTree,
    caller: str,
    donated: frozenset[int] = frozenset(),
    named_after: Callable[..., Any] | None = None,
) -> PyTree:
    """`run(fn, args, kwargs, options)` for arguments holding objects, whose new state `fn` leaves
    in them.

    Args:
      run: the strategy's `run` of a function, positional and keyword arguments, and `RunOptions`
        (or None).
      fn: the user's function.
      found: the objects in `(args, kwargs)`, and the rest of them.
      caller: the call to name in messages.
      donated: the positions in `found.objects` of the objects whose state is donated.
      named_after: what the caller passed to `run` as its function (a Module called as one, say,
        where `fn` calls it), which the step made of `fn` names as `program_of` (`fn` if None).
    """
    traversal = traverse(found.objects)
    values = [
        leaf.get_raw_value() if held_by_variable else leaf
        for leaf, held_by_variable in zip(traversal.leaves, traversal.are_variables, strict=True)
    ]
    if has_wide_host_leaf(values):  # A Variable given a 64-bit numpy value since `put`, say.
        names = [_variable_name(path, found.object_paths) for path in traversal.leaf_paths]
        require_named_representable(list(zip(names, values, strict=True)), caller=caller)
    # A Variable reached from a donated object first is donated (each is traversed once).
    donated_leaves = (
        tuple(i for i, path in enumerate(traversal.leaf_paths) if path[0] in donated) if donated else ()
    )
    step = step_with_objects(
        fn, traversal.graphdef_key, found.slots, caller, donated_leaves, len(values), named_after or fn
    )
    if donated_leaves:
        if (shared := _donated_array_shared(values, donated_leaves, found, traversal, caller)) is not None:
            raise shared
        arguments = ([values[i] for i in donated_leaves], [values[i] for i in step.kept], found.other_leaves)
        try:
            outputs, changed = run(step, arguments, {}, _DONATE_FIRST)
        except jax.errors.JaxRuntimeError as error:
            if "donate the same buffer twice" not in str(error):
                raise
            # Refused before anything ran: say which Variables share the buffer.
            shared = _donated_array_shared(values, donated_leaves, found, traversal, caller, _buffer_of)
            if shared is None:
                raise
            raise shared from error
    else:
        outputs, changed = run(step, ([], values, found.other_leaves), {}, None)
    replicas_differ = [i for i, value in changed.items() if isinstance(value, PerReplica)]
    if replicas_differ:
        raise _replicas_differ_error(
            found, traversal, values, changed, replicas_differ, donated_leaves, caller
        )
    _write_back(found, traversal, values, changed)
    return outputs


def _donated_array_shared(
    values: list[Any],
    donated_leaves: tuple[int, ...],
    found: ObjectsInTree,
    traversal: Traversal,
    caller: str,
    key: Callable[[Any], Any] = id,
) -> ValueError | None:
    """The error to raise if an array a donated Variable holds is also held elsewhere in the call
    (another Variable, as after `nnx.update(ema, nnx.state(model))`, or an argument): donation
    would delete it there too. `key` tells arrays apart: by identity (cheap, every call), or by buffer
    (`_buffer_of`, once XLA has refused a buffer donated twice: `put` gives one array placed twice
    two wrappers of one buffer)."""
    donated_at: dict[Any, int] = {}
    shared: tuple[int, str] | None = None
    for i in donated_leaves:
        if isinstance(values[i], jax.Array):
            if key(values[i]) in donated_at:
                shared = (
                    donated_at[key(values[i])],
                    _variable_name(traversal.leaf_paths[i], found.object_paths),
                )
                break
            donated_at[key(values[i])] = i
    if shared is None:
        donated_set = set(donated_leaves)
        for i, value in enumerate(values):
            if i not in donated_set and isinstance(value, jax.Array) and key(value) in donated_at:
                shared = (donated_at[key(value)], _variable_name(traversal.leaf_paths[i], found.object_paths))
                break
    others = [leaf for leaf in jax.tree.leaves(found.other_leaves) if isinstance(leaf, jax.Array)]
    if shared is None and any(key(leaf) in donated_at for leaf in others):
        # Only now are the arguments' paths worth formatting.
        arguments = found.slots.fill(found.objects, found.other_leaves)
        for path, leaf in jax.tree_util.tree_flatten_with_path(arguments, is_leaf=is_nnx_object)[0]:
            if isinstance(leaf, jax.Array) and key(leaf) in donated_at:
                shared = (donated_at[key(leaf)], format_argument_path(path))
                break
    if shared is None:
        return None
    i, where = shared
    return ValueError(
        f"{caller}: {_variable_name(traversal.leaf_paths[i], found.object_paths)} is donated (RunOptions), "
        f"but the array it holds is also held by {where}. Donation deletes the array, so it "
        "cannot stay there. Give one of them a copy of its own (jnp.copy), or do not donate "
        "this object."
    )


def _buffer_of(array: jax.Array) -> int:
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


def _replicas_differ_error(
    found: ObjectsInTree,
    traversal: Traversal,
    values: list[Any],
    changed: dict[int, Any],
    replicas_differ: list[int],
    donated_leaves: tuple[int, ...],
    caller: str,
) -> ValueError:
    """The error for updates that may differ between replicas. Objects not donated are left as
    they were; donated ones gave their arrays to the program, so they take what can be taken."""
    donated_set = set(donated_leaves)
    names = [_variable_name(traversal.leaf_paths[i], found.object_paths) for i in replicas_differ]
    if donated_set:
        _write_back(
            found,
            traversal,
            values,
            {i: v for i, v in changed.items() if i in donated_set and i not in replicas_differ},
        )
    lost = [name for i, name in zip(replicas_differ, names, strict=True) if i in donated_set]
    what = "so the objects were left as they were."
    if donated_set and not lost:
        what = (
            "so these were not updated. The donated objects took their other new values (their "
            "old arrays were given to the step); objects not donated were left as they were."
        )
    if lost:
        what = (
            "so these were not updated, and these of them were donated (RunOptions), so they now "
            f"hold deleted arrays:{bullet_list(lost)}\nRebuild their objects, or restore a "
            "checkpoint. The donated objects' other Variables took their new values; objects not "
            "donated were left as they were."
        )
    return ValueError(
        f"{caller}: fn updated these Variables of its Flax NNX arguments with values that may "
        f"differ between replicas:{bullet_list(names)}\nA Variable holds one value for every "
        f"replica, {what} Make the update the same everywhere: "
        "all-reduce the gradients before optimizer.update (get_replica_context().all_reduce"
        "('mean', grads)), and give nnx.BatchNorm axis_name='replica' so that its statistics "
        "are averaged."
    )


def _write_back(
    found: ObjectsInTree, traversal: Traversal, values: list[Any], changed: dict[int, Any]
) -> None:
    if all(traversal.are_variables):
        for i, value in changed.items():
            # The assignment inside `set_raw_value` checks the trace again (`Variable.__setattr__`),
            # so skipping its first check loses nothing (flax 0.12.8) and halves the write's cost
            # (docs/performance.md, "Flax NNX objects through `run`").
            traversal.leaves[i].set_raw_value(value, _unsafe_bypass_check=True)
    elif changed:  # Arrays held as plain attributes: rebuilt objects give them back by attribute.
        nnx = loaded_nnx()
        new_values = [changed.get(i, value) for i, value in enumerate(values)]
        nnx.update(found.objects, nnx.state(nnx.graph.unflatten(traversal.graphdef, new_values)))


def _variable_name(path: tuple[Any, ...], object_paths: list[Any]) -> str:
    """A Variable's name as the caller writes it, such as `args[0].linear.kernel`: where its
    object was among the arguments, then its attributes."""
    index, *attributes = path
    return ".".join([format_argument_path(object_paths[index]), *(str(a) for a in attributes)])


def with_states(found: ObjectsInTree) -> PyTree:
    """The tree `found` in, with each object replaced by its state (`nnx.state`): what a
    checkpoint holds for it."""
    nnx = loaded_nnx()
    return found.slots.fill(tuple(nnx.state(obj) for obj in found.objects), found.other_leaves)


def update_from_states(found: ObjectsInTree, restored: PyTree) -> PyTree:
    """Write the states that `restored` (shaped like `with_states(found)`) holds for the objects
    into them; return the tree with the same objects and the rest of `restored`."""
    nnx = loaded_nnx()
    parts = found.slots.treedef.flatten_up_to(restored)
    positions = set(found.slots.object_positions)
    for obj, state in zip(found.objects, (parts[i] for i in found.slots.object_positions), strict=True):
        nnx.update(obj, state)
    return found.slots.fill(found.objects, [part for i, part in enumerate(parts) if i not in positions])
