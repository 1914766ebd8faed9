"""Which values are Flax NNX objects, and the traversal of a call's objects, kept while unchanged.

`run` asks of every argument node whether it is an NNX object, and traverses the objects of each
call into their graph definition and state leaves. NNX answers both anew every time; here the
first is answered once per type, and a traversal is reused while a cheap check shows its objects
unchanged (docs/internals.md, "Running a step", says why that check suffices).

jaxstrategy never imports flax for this: a program that passes NNX objects has imported it.
"""

from __future__ import annotations

import collections
import dataclasses
import sys
import weakref
from typing import Any

import jax

from jaxstrategy._src.core.jax_compat import is_tracer


def loaded_nnx() -> Any:
    """The `flax.nnx` module if the program has imported it, else None."""
    return sys.modules.get("flax.nnx")


# Whether values of a type are NNX objects, by type: NNX's own check costs microseconds a value
# (its Variable type check goes through a metaclass), and `run` asks it of every argument node.
_IS_OBJECT_TYPE: dict[type, bool] = {}
_IS_VARIABLE_TYPE: dict[type, bool] = {}


def is_nnx_object(x: Any) -> bool:
    """An NNX graph node but a Variable (flax.nnx must be loaded): a Variable is also a pytree of
    its value, which is how the state of the other style (`nnx.split`) travels, and stays."""
    known = _IS_OBJECT_TYPE.get(type(x))
    if known is None:
        nnx = loaded_nnx()
        known = _IS_OBJECT_TYPE[type(x)] = bool(nnx.graph.is_graph_node(x)) and not isinstance(
            x, nnx.Variable
        )
    return known


def is_nnx_variable(x: Any) -> bool:
    """`isinstance(x, nnx.Variable)`, by type (flax.nnx must be loaded)."""
    known = _IS_VARIABLE_TYPE.get(type(x))
    if known is None:
        known = isinstance(x, loaded_nnx().Variable)
        if not is_tracer(x):  # NNX answers for a tracer by its value.
            _IS_VARIABLE_TYPE[type(x)] = known
    return known


def is_variable(x: Any) -> bool:
    """Whether `x` is a Flax NNX Variable (False while flax.nnx is not loaded)."""
    return loaded_nnx() is not None and is_nnx_variable(x)


def is_object(x: Any) -> bool:
    """Whether `x` is an NNX object (a Module, an Optimizer, `nnx.Rngs`; not a Variable)."""
    return loaded_nnx() is not None and is_nnx_object(x)


def any_object_among(args: tuple[Any, ...]) -> bool:
    """Whether one of `args` itself is an NNX object: what `run`'s hot path can afford to check, so
    that a step first compiled for arrays is not handed a Module as a pytree."""
    if "flax.nnx" not in sys.modules:
        return False
    for arg in args:  # A plain loop, with the type lookup inline: this runs on every hot call.
        known = _IS_OBJECT_TYPE.get(type(arg))
        if known or (known is None and is_nnx_object(arg)):
            return True
    return False


@dataclasses.dataclass(frozen=True)
class Traversal:
    """What NNX's graph traversal of a call's objects found: their graph definition, and their
    state's leaves (Variables, each once, shared ones included, or arrays held as plain
    attributes) with their paths, in the definition's order; and what tells whether it still
    holds for the objects of a later call."""

    graphdef: Any
    leaves: tuple[Any, ...]
    are_variables: tuple[bool, ...]
    # Each leaf's path: the position of the object it was reached from, then attribute names.
    leaf_paths: tuple[Any, ...]
    fingerprint: Any  # The objects' pytree structure and the identities of their Variables.
    object_refs: tuple[weakref.ref[Any], ...]
    graphdef_key: GraphDefKey


class GraphDefKey:
    """A graph definition as a dict key, hashed once. NNX hashes a graph definition anew on every
    call, walking all of it, and a reused traversal hands `run` the same definition every step."""

    __slots__ = ("_hash", "graphdef")

    def __init__(self, graphdef: Any):
        self.graphdef = graphdef
        try:
            self._hash = hash(graphdef)
        except TypeError:  # A static attribute that cannot be hashed (a dict): identity will do.
            self._hash = id(graphdef)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraphDefKey) or other._hash != self._hash:
            return False
        if other.graphdef is self.graphdef:
            return True
        try:
            return bool(other.graphdef == self.graphdef)
        except TypeError:
            return False


# The last traversals, by the ids of the objects traversed. A step's objects are usually the same
# from call to call, and traversing them again would cost as much as writing their new values back.
_TRAVERSALS: collections.OrderedDict[tuple[int, ...], Traversal] = collections.OrderedDict()
_TRAVERSALS_KEPT = 16


def traverse(objects: tuple[Any, ...]) -> Traversal:
    """The traversal of `objects`, reused while a cheap check shows them unchanged: the same
    objects, holding the same Variables, with the same static attributes (JAX's pytree view of
    NNX objects holds those in its tree structure). Objects that are no pytrees
    (`nnx.Module, pytree=False`) hide their insides from that check, so they are traversed anew."""
    nnx = loaded_nnx()
    view, treedef = jax.tree.flatten(objects, is_leaf=is_nnx_variable)
    fingerprint = (treedef, tuple(map(id, view)))
    checkable = not any(is_nnx_object(leaf) for leaf in view)
    key = tuple(map(id, objects))
    kept = _TRAVERSALS.get(key)
    if (
        checkable
        and kept is not None
        and kept.fingerprint == fingerprint
        and all(ref() is obj for ref, obj in zip(kept.object_refs, objects, strict=True))
    ):
        _TRAVERSALS.move_to_end(key)
        return kept
    graphdef, flat = nnx.graph.flatten(objects, with_paths=True)
    leaves = tuple(flat.leaves)
    traversal = Traversal(
        graphdef,
        leaves,
        tuple(isinstance(leaf, nnx.Variable) for leaf in leaves),
        tuple(flat.paths),
        fingerprint,
        tuple(weakref.ref(o) for o in objects),
        GraphDefKey(graphdef),
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
