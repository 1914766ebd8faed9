"""The step `run` compiles for a function of Flax NNX objects: `fn` as a function of their state.

Inside the trace the step rebuilds the objects from their state leaves, calls `fn`, and hands back
its outputs and the state leaves it changed. One step object is kept per function, graph
definition and argument structure, so that `run` finds it compiled from the second call on.
"""

from __future__ import annotations

import collections
import dataclasses
import types
import weakref
from collections.abc import Callable
from typing import Any

import jax

from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.steps.cache import function_key, weak_resolver
from jaxstrategy._src.steps.nnx_traversal import GraphDefKey, loaded_nnx


@dataclasses.dataclass(frozen=True)
class ObjectSlots:
    """Where the objects sit among the leaves of a tree such as `(args, kwargs)`: its structure and
    the objects' positions among its leaves. Hashable, since the compiled step is one per
    structure."""

    treedef: Any
    object_positions: tuple[int, ...]

    def fill(self, objects: tuple[Any, ...], other_leaves: list[Any]) -> Any:
        """The tree with `objects` in their slots and `other_leaves` in the rest, in order."""
        leaves, objects_iter, others_iter = [], iter(objects), iter(other_leaves)
        for i in range(self.treedef.num_leaves):
            leaves.append(next(objects_iter) if i in self.object_positions else next(others_iter))
        return jax.tree.unflatten(self.treedef, leaves)


# One step object per (function, graph definition, argument structure): `run` compiles each once.
_STEPS: collections.OrderedDict[Any, StepWithObjects] = collections.OrderedDict()
_STEPS_KEPT = 64


def step_with_objects(
    fn: Callable[..., PyTree],
    graphdef_key: GraphDefKey,
    slots: ObjectSlots,
    caller: str,
    donated: tuple[int, ...],
    count: int,
    named_after: Callable[..., Any],
) -> StepWithObjects:
    """The step `run` compiles for `fn` with objects of this structure, the same object every
    call, so `run` finds it compiled (on its fast path). It holds `fn` and `named_after` weakly,
    and goes when `fn` (or a bound method's object) does.

    Args:
      fn: the function of the objects (and other arguments) to call inside the trace.
      graphdef_key: the objects' graph definition (`Traversal.graphdef_key`).
      slots: where the objects go among the arguments.
      caller: the call to name in messages.
      donated: the positions, among the state leaves, of the donated ones (ascending).
      count: how many state leaves there are.
      named_after: what was passed to `run` as its function, which names the traced program.
    """
    key = (function_key(fn), graphdef_key, slots, caller, donated, function_key(named_after))
    step = _STEPS.get(key)
    if step is not None:
        _STEPS.move_to_end(key)
        return step
    step = _STEPS[key] = StepWithObjects(
        weak_resolver(fn),
        weak_resolver(named_after),
        getattr(fn, "__name__", "step"),
        graphdef_key.graphdef,
        slots,
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
class StepWithObjects:
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
    slots: ObjectSlots
    caller: str
    donated: tuple[int, ...]  # The positions, among the state leaves, of the donated ones (ascending).
    kept: tuple[int, ...]  # And of the others: worked out once, not on every call.

    @property
    def __name__(self) -> str:  # JAX names the compiled program after the user's function.
        return self.name

    def __call__(
        self, donated_values: list[Any], kept_values: list[Any], other_leaves: list[Any]
    ) -> tuple[PyTree, dict[int, Any]]:
        """`fn`'s outputs, and the new values of the state leaves it changed or that were donated,
        by position. The state leaves come in two lists: the donated ones, at `self.donated`, and
        the others.

        Only those leave the program: returning a value that `fn` left alone would make XLA copy
        it (docs/performance.md, "Flax NNX objects through `run`", has the evaluation step's
        figures), and the caller would write it back for nothing. A donated value must come back
        even unchanged: the array that went in is deleted.
        """
        values = list(kept_values)
        for i, value in zip(self.donated, donated_values, strict=True):
            values.insert(i, value)  # In ascending order, so every earlier position is filled.
        # A value that is not one array (a dict a Variable holds, say) may be changed in place:
        # its leaves, by identity, tell. A static one (a string) never changes.
        leaves_before = {i: jax.tree.leaves(v) for i, v in enumerate(values) if not is_tracer(v)}
        nnx = loaded_nnx()
        objects = nnx.graph.unflatten(self.graphdef, values)
        args, kwargs = self.slots.fill(objects, other_leaves)
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
