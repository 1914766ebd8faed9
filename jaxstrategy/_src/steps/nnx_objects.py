"""Flax NNX objects (a Module, an Optimizer, `nnx.Rngs`) as arguments of `put` and `run`.

Flax's own training loop passes objects and updates them in place (`optimizer.update(model,
grads)`), and `nnx.jit` carries those updates out of the compiled function. `run` does the
same: the objects among its arguments are traversed into their graph definition (static, so
`fn` compiles once for it) and their Variables' values (traced arrays), rebuilt inside, and after
`fn` the new values are written back into the caller's Variables. Shared references survive,
because all the objects of one call are traversed together. The traversal is kept while the
objects are unchanged, which saves about 0.3 ms a step for an MLP and its optimizer (`nnx.jit`
pays it every call). `put` places the objects' state and writes it back.

On several replicas an object can only take a value that is the same on every replica: a
Variable holds one array, never a `PerReplica`. An update that the replication analysis cannot
show to be the same everywhere (gradients that were not all-reduced, `nnx.BatchNorm` without
`axis_name='replica'`) is an error that names the Variables, and the objects are left as they
were.

jaxstrategy never imports flax for this: a program that passes NNX objects has imported it.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax

from jaxstrategy._src.core.errors import bullet_list, format_argument_path
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.tree_checks import has_wide_host_leaf, require_named_representable
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.steps.argument_roles import ArgumentRoles
from jaxstrategy._src.steps.cache import function_key, weak_resolver
from jaxstrategy._src.values.options import RunOptions
from jaxstrategy._src.values.per_replica import PerReplica


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


# Whether values of a type are NNX objects, by type: NNX's own check costs microseconds a value
# (its Variable type check goes through a metaclass), and `run` asks it of every argument node.
_IS_OBJECT_TYPE: dict[type, bool] = {}


def _is_object(x: Any) -> bool:
    """An NNX graph node but a Variable: a Variable is also a pytree of its value, which is how
    the state of the other style (`nnx.split`) travels, and stays."""
    known = _IS_OBJECT_TYPE.get(type(x))
    if known is None:
        nnx = _nnx()
        known = _IS_OBJECT_TYPE[type(x)] = bool(nnx.graph.is_graph_node(x)) and not isinstance(
            x, nnx.Variable
        )
    return known


_IS_VARIABLE_TYPE: dict[type, bool] = {}


def _is_variable(x: Any) -> bool:
    """`isinstance(x, nnx.Variable)`, by type: NNX's check goes through a metaclass."""
    known = _IS_VARIABLE_TYPE.get(type(x))
    if known is None:
        known = isinstance(x, _nnx().Variable)
        if not is_tracer(x):  # NNX answers for a tracer by its value.
            _IS_VARIABLE_TYPE[type(x)] = known
    return known


def is_variable(x: Any) -> bool:
    """Whether `x` is a Flax NNX Variable (False while flax.nnx is not loaded)."""
    return _nnx() is not None and _is_variable(x)


def is_object(x: Any) -> bool:
    """Whether `x` is an NNX object (a Module, an Optimizer, `nnx.Rngs`; not a Variable)."""
    return _nnx() is not None and _is_object(x)


def any_object_among(args: tuple[Any, ...]) -> bool:
    """Whether one of `args` itself is an NNX object: what `run`'s hot path can afford to check, so
    that a step first compiled for arrays is not handed a Module as a pytree."""
    if "flax.nnx" not in sys.modules:
        return False
    for arg in args:  # A plain loop: this runs on every call of run's hot path.
        known = _IS_OBJECT_TYPE.get(type(arg))
        if known or (known is None and _is_object(arg)):
            return True
    return False


def callee_as_argument(
    fn: Callable[..., PyTree], args: tuple[Any, ...]
) -> tuple[Callable[..., PyTree], tuple[Any, ...]]:
    """`fn` and `args`, with an object called as `fn` (a Module, or its bound method) made the first
    argument, so that its Variables are traced and updated rather than baked into the program."""
    if _nnx() is None:
        return fn, args
    if type(fn) is types.MethodType and _is_object(fn.__self__):
        return _method_caller(fn.__func__), (fn.__self__, *args)
    if _is_object(fn):
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
class _Holes:
    """Where the objects sit among the leaves of `(args, kwargs)`; hashable, since the compiled
    step is one per structure."""

    treedef: Any
    object_positions: tuple[int, ...]

    def fill(self, objects: tuple[Any, ...], others: list[Any]) -> Any:
        leaves, objects_iter, others_iter = [], iter(objects), iter(others)
        for i in range(self.treedef.num_leaves):
            leaves.append(next(objects_iter) if i in self.object_positions else next(others_iter))
        return jax.tree.unflatten(self.treedef, leaves)


@dataclasses.dataclass(frozen=True)
class Found:
    """The NNX objects among the leaves of a tree, its other leaves, where the objects go, and
    the objects' key paths."""

    objects: tuple[Any, ...]
    others: list[Any]
    holes: _Holes
    paths: list[Any]


def find_objects(tree: PyTree) -> Found | None:
    """The NNX objects in `tree` and the rest of it, or None when it holds none."""
    if _nnx() is None:  # No program passes NNX objects without having imported flax.nnx.
        return None
    # A PerReplica stays whole: `run` gives each replica its component.
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, PerReplica) or _is_object(x)
    )
    positions = tuple(i for i, (_, leaf) in enumerate(path_leaves) if _is_object(leaf))
    if not positions:
        return None
    return Found(
        objects=tuple(path_leaves[i][1] for i in positions),
        others=[leaf for i, (_, leaf) in enumerate(path_leaves) if i not in positions],
        holes=_Holes(treedef, positions),
        paths=[path_leaves[i][0] for i in positions],
    )


def put_objects(found: Found, place: Callable[[PyTree], PyTree]) -> PyTree:
    """Place the state of the objects `found` in a tree, and its other leaves, with `place`; the
    objects are updated in place and the tree comes back holding the same objects."""
    nnx = _nnx()
    state, placed_others = place((nnx.state(found.objects), found.others))
    nnx.update(found.objects, state)
    return found.holes.fill(found.objects, placed_others)


def donated_objects(
    found: Found, args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions, caller: str
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
    others = [name for name, value in named if not _is_object(value)]
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


def run_with_objects(
    run: Callable[..., PyTree],
    fn: Callable[..., PyTree],
    found: Found,
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
    traversal = _traverse(found.objects)
    values = [
        leaf.get_raw_value() if is_variable else leaf
        for leaf, is_variable in zip(traversal.leaves, traversal.are_variables, strict=True)
    ]
    if has_wide_host_leaf(values):  # A Variable given a 64-bit numpy value since `put`, say.
        names = [_variable_name(path, found.paths) for path in traversal.paths]
        require_named_representable(list(zip(names, values, strict=True)), caller=caller)
    # A Variable reached from a donated object first is donated (each is traversed once).
    donated_leaves = (
        tuple(i for i, path in enumerate(traversal.paths) if path[0] in donated) if donated else ()
    )
    step = _step_with_objects(
        fn, traversal.graphdef_key, found.holes, caller, donated_leaves, len(values), named_after or fn
    )
    if donated_leaves:
        if (shared := _donated_array_shared(values, donated_leaves, found, traversal, caller)) is not None:
            raise shared
        arguments = ([values[i] for i in donated_leaves], [values[i] for i in step.kept], found.others)
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
        outputs, changed = run(step, ([], values, found.others), {}, None)
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
    found: Found,
    traversal: _Traversal,
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
                shared = (donated_at[key(values[i])], _variable_name(traversal.paths[i], found.paths))
                break
            donated_at[key(values[i])] = i
    if shared is None:
        donated_set = set(donated_leaves)
        for i, value in enumerate(values):
            if i not in donated_set and isinstance(value, jax.Array) and key(value) in donated_at:
                shared = (donated_at[key(value)], _variable_name(traversal.paths[i], found.paths))
                break
    others = [leaf for leaf in jax.tree.leaves(found.others) if isinstance(leaf, jax.Array)]
    if shared is None and any(key(leaf) in donated_at for leaf in others):
        # Only now are the arguments' paths worth formatting.
        arguments = found.holes.fill(found.objects, found.others)
        for path, leaf in jax.tree_util.tree_flatten_with_path(arguments, is_leaf=_is_object)[0]:
            if isinstance(leaf, jax.Array) and key(leaf) in donated_at:
                shared = (donated_at[key(leaf)], format_argument_path(path))
                break
    if shared is None:
        return None
    i, where = shared
    return ValueError(
        f"{caller}: {_variable_name(traversal.paths[i], found.paths)} is donated (RunOptions), "
        f"but the array it holds is also held by {where}. Donation deletes the array, so it "
        "cannot stay there. Give one of them a copy of its own (jnp.copy), or do not donate "
        "this object."
    )


def _buffer_of(array: jax.Array) -> int:
    return array.addressable_shards[0].data.unsafe_buffer_pointer()


def _replicas_differ_error(
    found: Found,
    traversal: _Traversal,
    values: list[Any],
    changed: dict[int, Any],
    replicas_differ: list[int],
    donated_leaves: tuple[int, ...],
    caller: str,
) -> ValueError:
    """The error for updates that may differ between replicas. Objects not donated are left as
    they were; donated ones gave their arrays to the program, so they take what can be taken."""
    donated_set = set(donated_leaves)
    names = [_variable_name(traversal.paths[i], found.paths) for i in replicas_differ]
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


def _write_back(found: Found, traversal: _Traversal, values: list[Any], changed: dict[int, Any]) -> None:
    if all(traversal.are_variables):
        for i, value in changed.items():
            # The assignment inside `set_raw_value` checks the trace again (`Variable.__setattr__`),
            # so skipping its first check loses nothing (flax 0.12.8) and halves their cost: ~1 us
            # a Variable, 20 of them per step for an MLP and its optimizer.
            traversal.leaves[i].set_raw_value(value, _unsafe_bypass_check=True)
    elif changed:  # Arrays held as plain attributes: rebuilt objects give them back by attribute.
        nnx = _nnx()
        new_values = [changed.get(i, value) for i, value in enumerate(values)]
        nnx.update(found.objects, nnx.state(nnx.graph.unflatten(traversal.graphdef, new_values)))


@dataclasses.dataclass(frozen=True)
class _Traversal:
    """What NNX's graph traversal of a call's objects found: their graph definition, and their
    state's leaves (Variables, each once, shared ones included, or arrays held as plain
    attributes) with their paths, in the definition's order."""

    graphdef: Any
    leaves: tuple[Any, ...]
    are_variables: tuple[bool, ...]
    paths: tuple[Any, ...]
    fingerprint: Any
    objects: tuple[weakref.ref[Any], ...]
    graphdef_key: Any  # The graph definition as a cache key, hashed once (see `_GraphDefKey`).


class _GraphDefKey:
    """A graph definition as a dict key, hashed once. NNX hashes a graph definition anew on every
    call, walking all of it (~0.1 ms for an MLP and its optimizer), and a cached traversal hands
    `run` the same definition every step."""

    __slots__ = ("graphdef", "_hash")

    def __init__(self, graphdef: Any):
        self.graphdef = graphdef
        try:
            self._hash = hash(graphdef)
        except TypeError:  # A static attribute that cannot be hashed (a dict): identity will do.
            self._hash = id(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _GraphDefKey) or other._hash != self._hash:
            return False
        if other.graphdef is self.graphdef:
            return True
        try:
            return bool(other.graphdef == self.graphdef)
        except TypeError:
            return False


# How `run_with_objects` donates: the first argument of its step holds the donated state leaves.
_DONATE_FIRST = RunOptions(donate_argnums=0)

# The last traversals, by the ids of the objects traversed. A step's objects are usually the same
# from call to call, and the traversal (~0.3 ms for an MLP and its optimizer, measured) would
# cost as much again as writing the new values back.
_TRAVERSALS: collections.OrderedDict[tuple[int, ...], _Traversal] = collections.OrderedDict()
_TRAVERSALS_KEPT = 16


def _traverse(objects: tuple[Any, ...]) -> _Traversal:
    """The traversal of `objects`, reused while a cheap check shows them unchanged: the same
    objects, holding the same Variables, with the same static attributes (JAX's pytree view of
    NNX objects holds those in its tree structure). Objects that are no pytrees
    (`nnx.Module, pytree=False`) hide their insides from that check, so they are traversed anew."""
    nnx = _nnx()
    view, treedef = jax.tree.flatten(objects, is_leaf=_is_variable)
    fingerprint = (treedef, tuple(map(id, view)))
    checkable = not any(_is_object(leaf) for leaf in view)
    key = tuple(map(id, objects))
    cached = _TRAVERSALS.get(key)
    if (
        checkable
        and cached is not None
        and cached.fingerprint == fingerprint
        and all(ref() is obj for ref, obj in zip(cached.objects, objects, strict=True))
    ):
        _TRAVERSALS.move_to_end(key)
        return cached
    graphdef, flat = nnx.graph.flatten(objects, with_paths=True)
    leaves = tuple(flat.leaves)
    traversal = _Traversal(
        graphdef,
        leaves,
        tuple(isinstance(leaf, nnx.Variable) for leaf in leaves),
        tuple(flat.paths),
        fingerprint,
        tuple(weakref.ref(o) for o in objects),
        _GraphDefKey(graphdef),
    )
    if checkable:
        if key not in _TRAVERSALS:
            # It holds the Variables: it must not keep a dead model's arrays alive.
            for obj in objects:
                weakref.finalize(obj, _TRAVERSALS.pop, key, None)
        _TRAVERSALS[key] = traversal
        if len(_TRAVERSALS) > _TRAVERSALS_KEPT:
            _TRAVERSALS.popitem(last=False)
    return traversal


# One step object per (function, graph definition, argument structure): `run` compiles each once.
_STEPS: collections.OrderedDict[Any, _StepWithObjects] = collections.OrderedDict()
_STEPS_KEPT = 64


def _step_with_objects(
    fn: Callable[..., PyTree],
    graphdef_key: _GraphDefKey,
    holes: _Holes,
    caller: str,
    donated: tuple[int, ...],
    count: int,
    named_after: Callable[..., Any],
) -> _StepWithObjects:
    """The step `run` compiles for `fn` with objects of this structure, the same object every
    call, so `run` finds it compiled (on its fast path). It holds `fn` and `named_after` weakly,
    and goes when `fn` (or a bound method's object) does."""
    key = (function_key(fn), graphdef_key, holes, caller, donated, function_key(named_after))
    step = _STEPS.get(key)
    if step is not None:
        _STEPS.move_to_end(key)
        return step
    step = _STEPS[key] = _StepWithObjects(
        weak_resolver(fn),
        weak_resolver(named_after),
        getattr(fn, "__name__", "step"),
        graphdef_key.graphdef,
        holes,
        caller,
        donated,
        tuple(sorted(set(range(count)).difference(donated))),
    )
    if len(_STEPS) > _STEPS_KEPT:
        _STEPS.popitem(last=False)
    try:
        weakref.finalize(fn.__self__ if type(fn) is types.MethodType else fn, _STEPS.pop, key, None)
    except TypeError:  # Not weakly referenceable: the step holds it, and the cache's size bounds them.
        pass
    return step


@dataclasses.dataclass(frozen=True, eq=False)
class _StepWithObjects:
    """`fn` as a function of its objects' state leaves and of its other arguments.

    A callable object, not a closure: `run` warns when one piece of code is compiled as many
    function objects (a lambda made per step), but a new optimizer, whose optax transformation is
    part of its graph definition, rightly compiles a step of its own.
    """

    resolve: Callable[[], Callable[..., PyTree]]
    # What was passed to `run` as its function: a program check names this step's traced program
    # after it (`program_of`), since that is what each `run` call reports.
    program_of: Callable[[], Callable[..., Any]]
    name: str
    graphdef: Any
    holes: _Holes
    caller: str
    donated: tuple[int, ...]  # The positions, among the state leaves, of the donated ones (ascending).
    kept: tuple[int, ...]  # And of the others: worked out once, not on every call.

    @property
    def __name__(self) -> str:  # JAX names the compiled program after the user's function.
        return self.name

    def __call__(
        self, donated_values: list[Any], kept_values: list[Any], others: list[Any]
    ) -> tuple[PyTree, dict[int, Any]]:
        """`fn`'s outputs, and the new values of the state leaves it changed or that were donated,
        by position. The state leaves come in two lists: the donated ones, at `self.donated`, and
        the others.

        Only those leave the program: returning a value that `fn` left alone would make XLA copy
        it (measured: 0.5 ms a call for an MLP and its Adam state, in a step that updates nothing),
        and `run_with_objects` would write it back for nothing. A donated value must come back
        even unchanged: the array that went in is deleted.
        """
        values = list(kept_values)
        for i, value in zip(self.donated, donated_values, strict=True):
            values.insert(i, value)  # In ascending order, so every earlier position is filled.
        # A value that is not one array (a dict a Variable holds, say) may be changed in place:
        # its leaves, by identity, tell. A static one (a string) never changes.
        leaves_before = {i: jax.tree.leaves(v) for i, v in enumerate(values) if not is_tracer(v)}
        nnx = _nnx()
        objects = nnx.graph.unflatten(self.graphdef, values)
        args, kwargs = self.holes.fill(objects, others)
        outputs = self.resolve()(*args, **kwargs)
        new_graphdef, new_values = nnx.graph.flatten(objects, with_paths=False)
        if new_graphdef != self.graphdef:
            raise ValueError(
                f"{self.caller}: fn changed the structure of its Flax NNX arguments: it added, removed "
                "or replaced an attribute, a submodule or a Variable, or changed a static attribute "
                "(model.eval() and model.train() set flags). A compiled step can only change the "
                "values of Variables that exist when it starts: create them, and set such flags, "
                "before calling run; inside fn only assign to values (variable[...] = ...)."
            )
        # An untouched array comes back as the very tracer that went in.
        changed = {
            i: new
            for i, (new, old) in enumerate(zip(new_values, values, strict=True))
            if i in self.donated or _differs(new, old, leaves_before.get(i))
        }
        return outputs, changed


def _differs(new: Any, old: Any, old_leaves: list[Any] | None) -> bool:
    """Whether a state leaf's value changed: another object, or for a value that is not one array,
    other leaves (`old_leaves`, taken before `fn` ran)."""
    if new is not old or old_leaves is None:
        return new is not old
    new_leaves = jax.tree.leaves(new)
    if len(new_leaves) != len(old_leaves):
        return True
    return any(a is not b for a, b in zip(new_leaves, old_leaves, strict=True))


def _variable_name(path: tuple[Any, ...], object_paths: list[Any]) -> str:
    """A Variable's name as the caller writes it, such as `args[0].linear.kernel`: where its
    object was among the arguments, then its attributes."""
    index, *attributes = path
    return ".".join([format_argument_path(object_paths[index]), *(str(a) for a in attributes)])


def with_states(found: Found) -> PyTree:
    """The tree `found` in, with each object replaced by its state (`nnx.state`): what a
    checkpoint holds for it."""
    nnx = _nnx()
    return found.holes.fill(tuple(nnx.state(obj) for obj in found.objects), found.others)


def update_from_states(found: Found, restored: PyTree) -> PyTree:
    """Write the states that `restored` (shaped like `with_states(found)`) holds for the objects
    into them; return the tree with the same objects and the rest of `restored`."""
    nnx = _nnx()
    parts = found.holes.treedef.flatten_up_to(restored)
    positions = set(found.holes.object_positions)
    for obj, state in zip(found.objects, (parts[i] for i in found.holes.object_positions), strict=True):
        nnx.update(obj, state)
    return found.holes.fill(found.objects, [part for i, part in enumerate(parts) if i not in positions])
