"""Flax NNX objects (a Module, an Optimizer, `nnx.Rngs`) as arguments of `put` and `run`.

Flax's own training loop passes objects and updates them in place (`optimizer.update(model,
grads)`), and `nnx.jit` carries those updates out of the compiled function. `run` does the
same: the objects among its arguments are split into their graph definition (static, so `fn`
compiles once for it) and their state (traced arrays), merged again inside, and after `fn` the
new state is written back into the caller's objects. Shared references survive, because all the
objects of one call are split together. `put` places the objects' state and writes it back.

On several replicas an object can only take a value that is the same on every replica: a
Variable holds one array, never a `PerReplica`. An update that the replication analysis cannot
show to be the same everywhere (gradients that were not all-reduced, `nnx.BatchNorm` without
`axis_name='replica'`) is an error that names the Variables, and the objects are left as they
were.

jaxstrategy never imports flax for this: a program that passes NNX objects has imported it.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import jax

from jaxstrategy._src.errors import bullet_list, format_argument_path
from jaxstrategy._src.per_replica import PerReplica, is_per_replica
from jaxstrategy._src.types import PyTree


def _nnx() -> Any:
    return sys.modules.get("flax.nnx")


def holds_objects(tree: PyTree) -> bool:
    """Whether `tree` holds NNX graph nodes (Modules, Optimizers, Rngs, ...)."""
    nnx = _nnx()
    if nnx is None:
        return False
    is_node = nnx.graph.is_graph_node
    return any(is_node(leaf) for leaf in jax.tree.leaves(tree, is_leaf=is_node))


@dataclasses.dataclass(frozen=True)
class _Holes:
    """Where the objects sit among the leaves of `(args, kwargs)`: hashable, so that it can be a
    static argument of the compiled step."""

    treedef: Any
    object_positions: tuple[int, ...]

    def fill(self, objects: tuple[Any, ...], others: list[Any]) -> Any:
        leaves, objects_iter, others_iter = [], iter(objects), iter(others)
        for i in range(self.treedef.num_leaves):
            leaves.append(next(objects_iter) if i in self.object_positions else next(others_iter))
        return jax.tree.unflatten(self.treedef, leaves)


def _split_objects(tree: PyTree) -> tuple[tuple[Any, ...], list[Any], _Holes, list[Any]]:
    """The objects among the leaves of `tree`, its other leaves, where the objects go, and the
    objects' key paths."""
    is_node = _nnx().graph.is_graph_node
    # A PerReplica stays whole: `run` gives each replica its component.
    path_leaves, treedef = jax.tree_util.tree_flatten_with_path(
        tree, is_leaf=lambda x: is_node(x) or isinstance(x, PerReplica)
    )
    positions = tuple(i for i, (_, leaf) in enumerate(path_leaves) if is_node(leaf))
    objects = tuple(path_leaves[i][1] for i in positions)
    others = [leaf for i, (_, leaf) in enumerate(path_leaves) if i not in positions]
    return objects, others, _Holes(treedef, positions), [path_leaves[i][0] for i in positions]


def put_objects(tree: PyTree, place: Callable[[PyTree], PyTree]) -> PyTree:
    """Place the state of the objects in `tree`, and its other leaves, with `place`; the objects
    are updated in place and `tree` comes back holding the same objects."""
    nnx = _nnx()
    objects, others, holes, _ = _split_objects(tree)
    state, placed_others = place((nnx.state(objects), others))
    nnx.update(objects, state)
    return holes.fill(objects, placed_others)


def run_with_objects(
    run: Callable[..., PyTree],
    fn: Callable[..., PyTree],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    caller: str,
) -> PyTree:
    """`run(fn, args, kwargs)` for arguments holding objects, whose new state `fn` leaves in them.

    Args:
      run: the strategy's `run`, without options.
      fn: the user's function.
      args: its positional arguments.
      kwargs: its keyword arguments.
      caller: the call to name in messages.
    """
    nnx = _nnx()
    objects, others, holes, object_paths = _split_objects((args, kwargs))
    graphdef, state = nnx.split(objects)
    static = {"fn": fn, "graphdef": graphdef, "holes": holes, "caller": caller}
    outputs, new_state = run(_call_with_objects, (state, others), static)
    replicas_differ = [
        path
        for path, leaf in jax.tree_util.tree_flatten_with_path(new_state, is_leaf=is_per_replica)[0]
        if isinstance(leaf, PerReplica)
    ]
    if replicas_differ:
        names = [_variable_name(path, object_paths) for path in replicas_differ]
        raise ValueError(
            f"{caller}: fn updated these Variables of its Flax NNX arguments with values that may "
            f"differ between replicas:{bullet_list(names)}\nA Variable holds one value for every "
            "replica, so the objects were left as they were. Make the update the same everywhere: "
            "all-reduce the gradients before optimizer.update (get_replica_context().all_reduce"
            "('mean', grads)), and give nnx.BatchNorm axis_name='replica' so that its statistics "
            "are averaged."
        )
    nnx.update(objects, new_state)
    return outputs


def _call_with_objects(
    state: PyTree, others: list[Any], *, fn: Callable[..., PyTree], graphdef: Any, holes: _Holes, caller: str
) -> tuple[PyTree, PyTree]:
    nnx = _nnx()
    objects = nnx.merge(graphdef, state)
    args, kwargs = holes.fill(objects, others)
    outputs = fn(*args, **kwargs)
    new_graphdef, new_state = nnx.split(objects)
    if new_graphdef != graphdef:
        raise ValueError(
            f"{caller}: fn changed the structure of its Flax NNX arguments (it added, removed or "
            "replaced an attribute, a submodule or a Variable). A compiled step can only change "
            "the values of Variables that exist when it starts: create them before calling run, "
            "and inside fn only assign to their values (variable[...] = ...)."
        )
    return outputs, new_state


def _variable_name(path: tuple[Any, ...], object_paths: list[Any]) -> str:
    """A state leaf's name as the caller writes it, such as `args[0].linear.kernel`: where its
    object was among the arguments, then its attributes."""
    index, *attributes = (getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))) for key in path)
    return ".".join(
        [format_argument_path(object_paths[index]), *(str(a) for a in attributes if a != "value")]
    )
