"""Measure a training step that takes Flax NNX objects through `strategy.run`, updated in place.

The workload is the input-pipeline benchmark's MLP 784-512-512-10 with adam and a batch of 128,
already on the device, on `OneDeviceStrategy`. Four ways to run the same training step are timed:

* pytree: the input-pipeline benchmark's step, which takes the parameters (`nnx.split` once,
  `nnx.merge` inside) and optax's state as pytrees and returns the new ones, through
  `strategy.run`: jaxstrategy's other style.
* objects: the step as Flax's documentation writes it (`optimizer.update(model, grads)` in
  place, returning the loss), with the objects passed to `strategy.run`.
* nnx.jit: the same step under `nnx.jit`, with the same objects.
* cached_partial: `nnx.cached_partial(nnx.jit(step), model, optimizer)`, Flax's fast path for a
  loop that always passes the same objects.

An evaluation step, which changes no state, is timed too: objects against the pytree style.

Each pair is timed side by side (alternating which goes first), with a batch of calls per round
and one wait at the end of each batch; the tables give per-call medians and the median of the
per-round ratios (see bench_util.py). Goals: objects at most 1.10x pytree, and faster than
plain `nnx.jit`. The script exits non-zero if a step was traced more than once.

    python bench/nnx.py            # the full benchmark
    python bench/nnx.py --quick    # a smoke test with a few rounds
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
from bench_util import Loop, call_loop, count_compiles, measure, parse_rounds, print_table
from flax import nnx
from input_pipeline import MLP, make_workload, random_batch

import jaxstrategy

GOAL_OVER_PYTREE = 1.10
FULL_ROUNDS = 20
QUICK_ROUNDS = 3
CALLS = 20
TRACES: collections.Counter[str] = collections.Counter()


def loss_fn(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def objects_step(variant: str) -> Callable[..., jax.Array]:
    def step(model: MLP, optimizer: nnx.Optimizer, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        TRACES[variant] += 1
        loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
        loss, grads = jaxstrategy.get_replica_context().all_reduce("mean", (loss, grads))
        optimizer.update(model, grads)
        return loss

    return step


def eval_loss(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """An evaluation step's work: it reads the model and changes none of its state."""
    return jaxstrategy.get_replica_context().all_reduce("mean", loss_fn(model, *batch))


def objects_eval(model: MLP, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    TRACES["objects eval"] += 1
    return eval_loss(model, batch)


def new_objects() -> tuple[MLP, nnx.Optimizer]:
    model = MLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)


def loops(strategy: jaxstrategy.OneDeviceStrategy, batch: Any) -> dict[str, Loop]:
    # pytree: the input-pipeline benchmark's step, parameters and optax state in and out.
    workload = make_workload()
    holder = {"state": strategy.put(workload.initial)}

    def pytree_call() -> jax.Array:
        params, opt_state, loss = strategy.run(workload.step, args=(*holder["state"], batch))
        holder["state"] = (params, opt_state)
        return loss

    # objects: Flax's loop through run.
    run_model, run_optimizer = strategy.put(new_objects())
    run_step = objects_step("objects")

    def objects_call() -> jax.Array:
        return strategy.run(run_step, args=(run_model, run_optimizer, batch))

    # nnx.jit, and its cached partial, on the same device.
    jit_model, jit_optimizer = strategy.put(new_objects())
    jit_step = nnx.jit(objects_step("nnx.jit"))
    cached_model, cached_optimizer = strategy.put(new_objects())
    cached_step = nnx.cached_partial(nnx.jit(objects_step("cached_partial")), cached_model, cached_optimizer)
    # Evaluation, which updates nothing: the model's state as a pytree, and the model itself.
    eval_model = strategy.put(MLP(nnx.Rngs(0)))
    eval_graphdef, eval_state = nnx.split(eval_model)

    def pytree_eval(state: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        TRACES["pytree eval"] += 1
        return eval_loss(nnx.merge(eval_graphdef, state), batch)

    return {
        "pytree eval": call_loop(lambda: strategy.run(pytree_eval, args=(eval_state, batch))),
        "objects eval": call_loop(lambda: strategy.run(objects_eval, args=(eval_model, batch))),
        "pytree": call_loop(pytree_call),
        "objects": call_loop(objects_call),
        "nnx.jit": call_loop(lambda: jit_step(jit_model, jit_optimizer, batch)),
        "cached_partial": call_loop(lambda: cached_step(batch)),
    }


def main() -> None:
    rounds = parse_rounds(__doc__.splitlines()[0], full=FULL_ROUNDS, quick=QUICK_ROUNDS)
    strategy = jaxstrategy.OneDeviceStrategy()
    batch = strategy.put(random_batch(np.random.default_rng(0)))
    # Outside every scope (nnx.jit's steps would find no replica context in one); every object
    # and the batch are committed to the strategy's device, so every variant computes there.
    timed_loops = loops(strategy, batch)
    for loop in timed_loops.values():  # Warm up: compile each once.
        loop(3)
    compiles = count_compiles()
    results = [
        measure("eval, vs pytree", timed_loops["pytree eval"], timed_loops["objects eval"], CALLS, rounds),
        measure("step, vs pytree", timed_loops["pytree"], timed_loops["objects"], CALLS, rounds),
        measure("step, vs nnx.jit", timed_loops["nnx.jit"], timed_loops["objects"], CALLS, rounds),
        measure("step, vs cached", timed_loops["cached_partial"], timed_loops["objects"], CALLS, rounds),
    ]
    print(f"jax {jax.__version__}; {strategy!r}; MLP 784-512-512-10, adam, batch 128; {rounds} rounds\n")
    print("Objects through run (other) against each way (base):")
    eval_over_pytree, over_pytree, over_jit, over_cached = print_table(results, ("base", "objects"))
    print(f"\ntraces: {dict(sorted(TRACES.items()))}; XLA compiles while timed: {compiles['backend']}")
    pytree_verdict = "met" if over_pytree <= GOAL_OVER_PYTREE else "NOT met"
    jit_verdict = "met" if over_jit < 1 else "NOT met"
    print(f"goal objects/pytree <= {GOAL_OVER_PYTREE:.2f}: {pytree_verdict} ({over_pytree:.3f})")
    eval_verdict = "met" if eval_over_pytree <= GOAL_OVER_PYTREE else "NOT met"
    print(f"goal objects/pytree <= {GOAL_OVER_PYTREE:.2f}, eval: {eval_verdict} ({eval_over_pytree:.3f})")
    print(f"goal objects faster than nnx.jit: {jit_verdict} ({over_jit:.3f})")
    print(f"objects/nnx.cached_partial: {over_cached:.3f}")
    if any(count != 1 for count in TRACES.values()) or compiles["backend"]:
        sys.exit(f"a step was traced more than once: {dict(TRACES)}")


if __name__ == "__main__":
    main()
