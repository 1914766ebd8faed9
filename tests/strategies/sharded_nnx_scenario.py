"""A scenario of the two-process `MultiWorkerShardedStrategy` job of test_sharded_job.py (run by
sharded_job_worker.py): a Flax NNX model annotated with logical axis names, trained in place
through `run`.

The kernels are annotated `nnx.with_partitioning(init, ('embed', 'mlp'))` and the reverse, the
logical names mapped by `RULES` (as Flax's `logical_axis_rules`) onto the replica's `'shard'` and
`'model'` axes; the `nnx.Optimizer` is updated in place in `run`. `train` trains the model with
one replica over both processes, each holding half of every kernel; `reference`, which the test
calls, trains the same model on one device.
"""

from __future__ import annotations

from typing import Any

import jax  # Importing starts nothing: MultiWorkerShardedStrategy() must still come first.
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import jaxstrategy

# Logical names to the replica's axes: the embedding dimension split over 'shard' (FSDP), the
# hidden one over 'model' (Megatron's column- then row-parallel pair).
RULES = (("embed", "shard"), ("mlp", "model"))


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(
            8,
            16,
            kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
            bias_init=nnx.with_partitioning(nnx.initializers.normal(0.1), ("mlp",)),
            rngs=rngs,
        )
        self.down = nnx.Linear(16, 4, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.relu(self.up(x)))


def objects() -> tuple[MLP, nnx.Optimizer]:
    """The model and its optimizer, as every run starts them: not yet placed (Flax would place
    each Variable as it is made, under a mesh: the strategy's `put` lays them out instead, from
    the same annotations, and several times faster than eager sharding's jit per Variable)."""
    with nnx.use_eager_sharding(False):
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.sgd(0.05, momentum=0.9), wrt=nnx.Param)


def loss_fn(model: MLP, batch: Any) -> jax.Array:
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def train_step(model: MLP, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    loss, grads = jaxstrategy.get_replica_context().all_reduce("mean", (loss, grads))
    optimizer.update(model, grads)  # In place: `run` writes the new values back.
    return loss


@nnx.jit
def _reference_step(model: MLP, optimizer: nnx.Optimizer, batch: Any) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss


def reference(batches: list[Any]) -> dict[str, Any]:
    """The same training on one device, under `nnx.jit`: the losses and final parameters."""
    model, optimizer = objects()
    losses = [float(_reference_step(model, optimizer, batch)) for batch in batches]
    return {"losses": losses, "params": _params(model)}


def _params(model: MLP) -> dict[str, Any]:
    # Each process holds only its devices' parts of a kernel split over the job: gather them.
    state = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    return jax.tree.map(
        lambda x: np.asarray(multihost_utils.process_allgather(x, tiled=True)).tolist(), state
    )


def _held_fraction(leaf: jax.Array) -> float:
    """What part of `leaf`'s elements this process's devices hold."""
    held = np.zeros(leaf.shape, bool)
    for shard in leaf.addressable_shards:
        held[shard.index] = True
    return float(held.mean())


def train(batches: list[Any]) -> dict[str, Any]:
    """Train on one replica over both processes (2 x 2 devices), split over 'shard' and 'model'."""
    strategy = jaxstrategy.MultiWorkerShardedStrategy(num_replicas=1, model_parallel=2, min_shard_bytes=0)
    model, optimizer = objects()
    # The logical names mean something only under their rules: `put` lays the objects out by
    # them. `run` needs them no more: it writes each new value back where the old one was.
    with nnx.logical_axis_rules(RULES):
        strategy.put((model, optimizer))
    kernel = model.up.kernel
    losses = [
        float(strategy.run(train_step, args=(model, optimizer, batch)))
        for batch in strategy.experimental_distribute_dataset(batches)
    ]
    assert model.up.kernel is kernel  # The same Variable, its value replaced.
    # Each kernel, and its momentum, which carries the kernel's annotation.
    layouts = {
        f"{path}/kernel": (layer.kernel[...], optimizer.opt_state[0].trace[path]["kernel"][...])
        for path, layer in (("up", model.up), ("down", model.down))
    }
    return {
        "losses": losses,
        "params": _params(model),
        "specs": {name: [str(tuple(leaf.sharding.spec)) for leaf in pair] for name, pair in layouts.items()},
        "held": {name: [_held_fraction(leaf) for leaf in pair] for name, pair in layouts.items()},
    }
