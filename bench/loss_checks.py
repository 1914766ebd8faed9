"""Measure what checking a traced `global_batch_size` costs inside a compiled training step.

`jaxstrategy.nn.compute_average_loss` cannot raise for a negative batch size computed inside
`run` (a traced value), as TensorFlow's run-time assertion does. Two ways to say so are timed
against a step without any check, each a jitted SGD step of an MLP whose loss is
`compute_average_loss` of its per-example losses over a global batch size passed in as an array:

* nan: the loss is nan when the batch size is negative (one `jnp.where`; what the library does).
* checkify: `jax.experimental.checkify.check(batch_size >= 0)`, the step checkified inside its
  `jax.jit` and the error thrown after every step, as a raising check must be (reading the error
  waits for the step, so the host can no longer queue the next step while this one runs).

Each is timed as a training loop (the new parameters fed back in) of a small MLP (batch 32,
8-16-1) and a larger one (batch 256, 784-512-10), in rounds that alternate which variant goes
first; the table gives the median of the per-round ratios to the unchecked step. Before timing,
the script checks that a negative batch size gives nan in one and raises in the other, and it
fails if XLA compiled anything while timed.

Run it from the repository root:

    python bench/loss_checks.py            # the full benchmark
    python bench/loss_checks.py --quick    # a smoke test with a few rounds
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from bench_util import Loop, count_compiles, measure, parse_rounds, print_table, training_loop
from jax.experimental import checkify

import jaxstrategy

# The nan check should cost nothing measurable: at most this ratio to the unchecked step.
GOAL_RATIO = 1.05
FULL_ROUNDS = 30
QUICK_ROUNDS = 5
CALLS = {"small": 200, "large": 50}
WARMUP_CALLS = 20
SIZES = {"small": (32, 8, 16, 1), "large": (256, 784, 512, 10)}


def unchecked_average(losses: jax.Array, global_batch_size: jax.Array) -> jax.Array:
    """`compute_average_loss` as it was before the check: TensorFlow's div_no_nan."""
    divisor = global_batch_size.astype(losses.dtype)
    total = jnp.sum(losses)
    return jnp.where(divisor == 0, jnp.zeros_like(total), total / jnp.where(divisor == 0, 1, divisor))


def checkified_average(losses: jax.Array, global_batch_size: jax.Array) -> jax.Array:
    checkify.check(
        global_batch_size >= 0, "global_batch_size must be non-negative; got {}", global_batch_size
    )
    return unchecked_average(losses, global_batch_size)


def nan_average(losses: jax.Array, global_batch_size: jax.Array) -> jax.Array:
    return jaxstrategy.nn.compute_average_loss(losses, global_batch_size=global_batch_size)


def make_step(average: Callable[[jax.Array, jax.Array], jax.Array]) -> Callable[[Any, Any], Any]:
    """One SGD step on the per-example squared errors of an MLP, averaged by `average`."""

    def loss_fn(params, batch):
        hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        prediction = hidden @ params["w2"] + params["b2"]
        per_example = jnp.sum((prediction - batch["y"]) ** 2, axis=1)
        return average(per_example, batch["global_batch_size"])

    def step(params, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    return step


def inputs(size: str) -> tuple[dict, dict]:
    batch_size, n_in, n_hidden, n_out = SIZES[size]
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> jax.Array:
        return jnp.asarray(rng.normal(size=shape).astype(np.float32))

    params = {
        "w1": normal(n_in, n_hidden) * 0.1,
        "b1": jnp.zeros(n_hidden),
        "w2": normal(n_hidden, n_out) * 0.1,
        "b2": jnp.zeros(n_out),
    }
    batch = {"x": normal(batch_size, n_in), "y": normal(batch_size, n_out)}
    batch["global_batch_size"] = jnp.asarray(batch_size, jnp.int32)
    return params, batch


def build_loops() -> dict[str, tuple[Loop, Loop, Loop, int]]:
    """Each case's (unchecked, nan, checkify) loops and calls per batch."""
    loops = {}
    for size in SIZES:
        params, batch = inputs(size)
        unchecked = jax.jit(make_step(unchecked_average))
        nan = jax.jit(make_step(nan_average))
        checked = jax.jit(checkify.checkify(make_step(checkified_average)))

        def checked_step(p: Any, b: Any, checked: Any = checked) -> Any:
            error, out = checked(p, b)
            error.throw()
            return out

        loops[size] = (
            training_loop(lambda p, b, f=unchecked: f(p, b), params, batch),
            training_loop(lambda p, b, f=nan: f(p, b), params, batch),
            training_loop(lambda p, b: checked_step(p, b), params, batch),
            CALLS[size],
        )
    return loops


def check_the_checks() -> None:
    """Exit non-zero unless a negative batch size gives nan in one variant and raises in the other."""
    params, batch = inputs("small")
    batch = {**batch, "global_batch_size": jnp.asarray(-1, jnp.int32)}
    _, loss = jax.jit(make_step(nan_average))(params, batch)
    error, _ = jax.jit(checkify.checkify(make_step(checkified_average)))(params, batch)
    if not np.isnan(float(loss)) or error.get() is None:
        raise SystemExit(f"FAIL: a negative batch size gave the loss {float(loss)}, the error {error.get()}.")


def main() -> None:
    rounds = parse_rounds(__doc__.splitlines()[0], full=FULL_ROUNDS, quick=QUICK_ROUNDS)
    check_the_checks()
    loops = build_loops()
    for *variants, _ in loops.values():
        for loop in variants:
            loop(WARMUP_CALLS)
    compiles = count_compiles()
    print(f"jax {jax.__version__} on {jax.devices()[0]}; {rounds} rounds\n")
    nan_results, checkify_results = [], []
    for size, (unchecked, nan, checked, calls) in loops.items():
        nan_results.append(measure(f"{size}: nan", unchecked, nan, calls, rounds))
        checkify_results.append(measure(f"{size}: checkify", unchecked, checked, calls, rounds))
    nan_ratios = print_table(nan_results, ("unchecked", "nan"))
    print()
    print_table(checkify_results, ("unchecked", "checkify"))
    if compiles["backend"]:
        raise SystemExit(f"FAIL: {compiles['backend']} XLA compiles while timed; the timings include them.")
    met = all(ratio <= GOAL_RATIO for ratio in nan_ratios)
    print(f"\ngoal ratio nan/unchecked <= {GOAL_RATIO:.2f} in both cases: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
