"""A small model trained through a strategy, and the same model trained by a plain `jax.jit`
loop on each whole global batch: the outside reference for the conformance suite's gradients.

SGD and SGD with momentum tell a correct gradient from one scaled by the number of replicas
(adam forgives any scale); the batches differ example by example, so replicas differ.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.experimental.multihost_utils
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jaxstrategy
from jaxstrategy.testing import assert_tree_on_strategy

OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "sgd_momentum": lambda: optax.sgd(0.1, momentum=0.9),
    # The threshold sits among the gradients' norms (2.0 to 3.3 on the first step's batches), so
    # the true norm decides which steps are clipped.
    "clip_sgd": lambda: optax.chain(optax.clip_by_global_norm(3.0), optax.sgd(0.1)),
    "adamw": lambda: optax.adamw(1e-2, weight_decay=1e-2),
}


def training_batches(sizes: list[int]) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(7)
    return [
        {"x": rng.normal(size=(size, 5)).astype(np.float32), "y": rng.normal(size=size).astype(np.float32)}
        for size in sizes
    ]


def initial_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "w1": rng.normal(size=(5, 8)).astype(np.float32) * 0.5,
        "b1": np.zeros(8, np.float32),
        "w2": rng.normal(size=(8,)).astype(np.float32) * 0.5,
    }


def per_example_loss(params, x, y):
    predictions = jnp.tanh(x @ params["w1"] + params["b1"]) @ params["w2"]
    return (predictions - y) ** 2


@functools.cache
def reference_training(
    optimizer: str, sizes: tuple[int, ...]
) -> tuple[tuple[float, ...], dict[str, np.ndarray]]:
    """The same model trained with `OPTIMIZERS[optimizer]` on `training_batches(sizes)`, each whole
    global batch in one plain `jax.jit` step: the losses and the final parameters.

    Cached: it depends on neither the strategy nor the idiom under test, and every strategy's
    tests compare against it. So what it returns cannot be changed: a tuple, read-only arrays.
    """
    tx, batches = OPTIMIZERS[optimizer](), training_batches(list(sizes))

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(per_example_loss(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.tree.map(jnp.asarray, initial_params())
    opt_state, losses = tx.init(params), []
    with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts.
        for batch in batches:
            params, opt_state, loss = step(params, opt_state, batch["x"], batch["y"])
            losses.append(float(loss))
    return tuple(losses), jax.tree.map(_read_only, params)


def _read_only(array: jax.Array) -> np.ndarray:
    copy = np.array(array)
    copy.flags.writeable = False
    return copy


def host_value(array) -> np.ndarray:
    """`array`'s value on the host; of an array split across processes (a replica of a
    multi-process sharded strategy spanning them), gathered from every process, which must all
    call this."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        return np.asarray(jax.experimental.multihost_utils.process_allgather(array, tiled=True))
    return np.asarray(array)


def strategy_training(strategy, tx, batches, idiom, options=None):
    """Train through `strategy.run` in one of TensorFlow's idioms; return the losses and the
    final parameters of this process's first replica."""
    params = strategy.put(initial_params())
    opt_state, losses = strategy.put(tx.init(params)), []
    with jax.numpy_dtype_promotion("standard"):
        for batch in strategy.experimental_distribute_dataset(batches, options):
            # The optimizer's functions and the idiom are static arguments: one step function
            # serves every test, compiled once for each.
            params, opt_state, loss = strategy.run(
                train_step, args=(params, opt_state, batch), kwargs={"tx": tx, "idiom": idiom}
            )
            losses.append(float(loss))
    assert_tree_on_strategy(params, strategy)
    return losses, jax.tree.map(host_value, strategy.experimental_local_results(params)[0])


def train_step(params, opt_state, batch, *, tx, idiom):
    """One step: "mean_loss" averages each replica's mean loss and gradients; "compute_average_loss"
    sums gradients of losses divided by the global batch; "masked" does that over a padded batch's
    real examples."""
    context = jaxstrategy.get_replica_context()
    if idiom == "masked":
        batch, mask = batch
        real_examples = context.all_reduce("sum", jnp.sum(mask, dtype=jnp.int32))
    x, y = batch["x"], batch["y"]
    if idiom == "mean_loss":
        loss, grads = jax.value_and_grad(lambda p: jnp.mean(per_example_loss(p, x, y)))(params)
        loss, grads = context.all_reduce("mean", (loss, grads))
    else:
        kwargs = {"sample_weight": mask, "global_batch_size": real_examples} if idiom == "masked" else {}
        loss, grads = jax.value_and_grad(
            lambda p: jaxstrategy.nn.compute_average_loss(per_example_loss(p, x, y), **kwargs)
        )(params)
        loss, grads = context.all_reduce("sum", (loss, grads))
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


# --- the training loop of Flax's documentation, with NNX objects ---------------------------------


class FlaxDocsMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden = nnx.Linear(5, 8, rngs=rngs)
        self.out = nnx.Linear(8, 1, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        # A key drawn each call, as dropout would, so the Rngs counter must advance; times zero,
        # so the numbers stay comparable with one device's (dropout masks depend on the split).
        noise = jax.random.normal(self.rngs(), ()) * 0.0
        return self.out(nnx.tanh(self.hidden(x)))[:, 0] + noise


def flax_docs_loss(model, batch):
    return jnp.mean((model(batch["x"]) - batch["y"]) ** 2)


def flax_docs_train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(flax_docs_loss)(model, batch)
    # The one line a replica adds; on one device it changes nothing.
    loss, grads = jaxstrategy.get_replica_context().all_reduce("mean", (loss, grads))
    optimizer.update(model, grads)  # In place.
    return loss


@nnx.jit
def _nnx_jit_train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(flax_docs_loss)(model, batch)
    optimizer.update(model, grads)
    return loss


def flax_docs_objects():
    model = FlaxDocsMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)


@dataclasses.dataclass(frozen=True)
class NnxJitRun:
    """What Flax's loop under `nnx.jit` ended with: the losses, the parameters, the key count."""

    losses: tuple[float, ...]
    params: dict  # Of read-only arrays: the run is cached.
    rng_count: int


@functools.cache
def nnx_jit_training(sizes: tuple[int, ...]) -> NnxJitRun:
    """The reference: Flax's loop under `nnx.jit`, on each whole global batch of
    `training_batches(sizes)`. Cached, as `reference_training` is."""
    model, optimizer = flax_docs_objects()
    losses = tuple(
        float(_nnx_jit_train_step(model, optimizer, batch)) for batch in training_batches(list(sizes))
    )
    params = jax.tree.map(_read_only, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    return NnxJitRun(losses, params, int(model.rngs.default.count[...]))
