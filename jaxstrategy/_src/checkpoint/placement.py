"""Where restoring puts each leaf: the target strategy's one sharding, or its layout leaf by leaf.

Most strategies hold every variable whole on each device, so `strategy.sharding` places every
leaf. `ShardedStrategy` splits large leaves over each replica's devices (`strategy.layout_of`):
restored onto its replicated `sharding`, a model bigger than one device would be gathered whole
onto every device. A `Placement` answers "where does the leaf at this path go?" for both, asked
of the tree as the user holds it, so that a leaf restores where `put` would have placed it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax

from jaxstrategy._src.checkpoint import stored_leaves
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.steps import nnx_objects
from jaxstrategy._src.strategies.strategy import Strategy


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where restored leaves go.

    Attributes:
      replicated: a sharding that holds a whole copy on each of the strategy's devices
        (`strategy.sharding`): every leaf's, without `layout`, and always the scalars that stand
        for zero-size arrays on disk, which have no dimension to split.
      layout: from a tree of leaves (arrays, `jax.ShapeDtypeStruct`s, NNX Variables) to where
        `put` would place them: one sharding for all, or a tree of them shaped like it, a Variable
        counting as one leaf; None when every leaf goes onto `replicated`.

    Example:
      >>> import jax, jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.ShardedStrategy(['/cpu:0', '/cpu:1'], min_shard_bytes=16)
      >>> tree = {'w': jnp.ones((4, 2)), 'b': [jnp.ones(3)]}
      >>> shardings = placement_of(strategy).shardings(tree)
      >>> tuple(shardings['w'].spec), tuple(shardings['b/0'].spec)
      (('shard', None), ())
    """

    replicated: jax.sharding.Sharding
    layout: Callable[[PyTree], PyTree] | None = None

    def shardings(self, tree: PyTree) -> dict[str, jax.sharding.Sharding]:
        """The sharding of each leaf of `tree`, by its path as a checkpoint names it
        (`stored_leaves.path_string`); a Variable's value at the Variable's path and below."""
        units = jax.tree_util.tree_flatten_with_path(tree, is_leaf=nnx_objects.is_variable)[0]
        layout = self.replicated if self.layout is None else self.layout(tree)
        if isinstance(layout, jax.sharding.Sharding):
            where = [layout] * len(units)
        else:
            where = jax.tree.leaves(layout, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        placed = {}
        for (path, unit), sharding in zip(units, where, strict=True):
            for inner, _ in jax.tree_util.tree_flatten_with_path(unit)[0]:
                placed[stored_leaves.path_string((*path, *inner))] = sharding
        return placed


def placement_of(strategy: Strategy) -> Placement:
    """Where `strategy` puts restored leaves: where its `put` places them (leaf by leaf on
    `ShardedStrategy`, all onto its `sharding` on the others)."""
    caller = "jaxstrategy.checkpoint.restore()"
    return Placement(strategy.sharding, functools.partial(strategy._placement.shardings_for, caller=caller))
