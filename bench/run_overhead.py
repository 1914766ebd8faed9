"""Measure what `OneDeviceStrategy.run` costs per call over a bare, cached `jax.jit` call.

Two steps are timed, each once through `strategy.run(fn, args=...)` and once through
`jax.jit(fn)(...)`:

* spec loop (int): the specification's `step_fn(x) = x * 2`, called with a different Python int
  each time (Python ints trace as weak int32, so a new value does not recompile).
* sgd step (tree): one SGD step of a small two-layer MLP whose parameters are a dict of four
  float32 arrays, on a batch already on the device; the new parameters are fed back in, as in a
  training loop.
* donated step (20 leaves): a step that updates a state of 20 small arrays, donated
  (`RunOptions(donate_argnums=(0,))` against `jax.jit(..., donate_argnums=0)`), the new state fed
  back in: the donating fast path, which checks that no donated array is also passed elsewhere.

Both variants are compiled during a warm-up. Then, for each round, a batch of calls of one variant
is timed and then a batch of the other, the order alternating between rounds, and each batch ends
with `jax.block_until_ready` on its last output inside the timed region. The table gives per-call
medians (p10-p90) and the median of the per-round run/jit ratios: the two batches of a round run
side by side, so their ratio cancels most of a noisy machine's drift. The ratio of the medians is
printed as well. Every step function counts its traces, and the script exits non-zero if any was
traced more than once or if XLA compiled anything after the warm-up.

Run it from the repository root:

    python bench/run_overhead.py            # the full benchmark
    python bench/run_overhead.py --quick    # a smoke test with a few rounds
    python bench/run_overhead.py --rounds 50
"""

from __future__ import annotations

import collections
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from bench_util import Loop, count_compiles, int_loop, measure, parse_rounds, print_table, training_loop

import jaxstrategy

# The ratio the project aims for, in both cases.
GOAL_RATIO = 1.10
FULL_ROUNDS = 30
QUICK_ROUNDS = 5
# Calls per timed batch: enough that one batch takes a few milliseconds, far above the timer's
# resolution and the cost of the final block_until_ready.
SPEC_CALLS = 500
SGD_CALLS = 200
DONATED_CALLS = 200
DONATED_LEAVES = 20
# The goal covers the first two cases; the donated step is reported against its own figure.
GOAL_CASES = ("spec loop (int)", "sgd step (tree)")
WARMUP_CALLS = 50

# Traces per step function, keyed by variant name. Python side effects run only while JAX traces,
# so each count must stay at 1 for the whole benchmark.
TRACES: collections.Counter[str] = collections.Counter()


def make_spec_step(variant: str) -> Callable[[Any], Any]:
    """Return the specification's `step_fn`, a fresh function per variant so traces count apart."""

    def step_fn(x):
        TRACES[variant] += 1
        return x * 2

    return step_fn


def make_sgd_step(variant: str) -> Callable[[dict, dict], tuple[dict, jax.Array]]:
    """Return one SGD step on an MLP's MSE loss, returning the new parameters and the loss."""

    def loss_fn(params, batch):
        hidden = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
        prediction = hidden @ params["w2"] + params["b2"]
        return jnp.mean((prediction - batch["y"]) ** 2)

    def sgd_step(params, batch):
        TRACES[variant] += 1
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        new_params = jax.tree.map(lambda p, g: p - 0.01 * g, params, grads)
        return new_params, loss

    return sgd_step


def make_donated_step(variant: str) -> Callable[[dict, jax.Array], tuple[dict, jax.Array]]:
    """Return a step that moves every leaf of a state towards the batch, and the mean distance."""

    def donated_step(state, batch):
        TRACES[variant] += 1
        new_state = {name: 0.9 * leaf + 0.1 * batch for name, leaf in state.items()}
        return new_state, jnp.mean(batch - new_state["leaf_0"])

    return donated_step


def donated_inputs(strategy: jaxstrategy.OneDeviceStrategy) -> tuple[dict, jax.Array]:
    state = {f"leaf_{i}": np.full(16, i, np.float32) for i in range(DONATED_LEAVES)}
    return strategy.put(state), strategy.put(np.ones(16, np.float32))


def sgd_inputs(strategy: jaxstrategy.OneDeviceStrategy) -> tuple[dict, dict]:
    """Return small float32 parameters and a batch, both committed to the strategy's device."""
    rng = np.random.default_rng(0)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(size=shape).astype(np.float32)

    params = {"w1": normal(8, 16) * 0.3, "b1": np.zeros(16, np.float32), "w2": normal(16, 1) * 0.3}
    params["b2"] = np.zeros(1, np.float32)
    x = normal(32, 8)
    batch = {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True))}
    # Placed once, before timing: the loop measures dispatch, not host-to-device copies.
    return strategy.put(params), strategy.put(batch)


def build_loops(strategy: jaxstrategy.OneDeviceStrategy) -> dict[str, tuple[Loop, Loop, int]]:
    """Return each case's (bare jit loop, run loop, calls per batch)."""
    params, batch = sgd_inputs(strategy)
    spec_jit, spec_run = jax.jit(make_spec_step("spec/jit")), make_spec_step("spec/run")
    sgd_jit, sgd_run = jax.jit(make_sgd_step("sgd/jit")), make_sgd_step("sgd/run")
    donated_jit = jax.jit(make_donated_step("donated/jit"), donate_argnums=0)
    donated_run, donate = make_donated_step("donated/run"), jaxstrategy.RunOptions(donate_argnums=(0,))
    # Each loop donates its own state (a donated array is gone after the call).
    jit_state, batch_20 = donated_inputs(strategy)
    run_state, _ = donated_inputs(strategy)
    # Both calls of a case sit in a lambda, so neither pays for an extra Python frame alone.
    return {
        "spec loop (int)": (
            int_loop(lambda i: spec_jit(i)),
            int_loop(lambda i: strategy.run(spec_run, args=(i,))),
            SPEC_CALLS,
        ),
        "sgd step (tree)": (
            training_loop(lambda p, b: sgd_jit(p, b), params, batch),
            training_loop(lambda p, b: strategy.run(sgd_run, args=(p, b)), params, batch),
            SGD_CALLS,
        ),
        f"donated step ({DONATED_LEAVES} leaves)": (
            training_loop(lambda s, b: donated_jit(s, b), jit_state, batch_20),
            training_loop(
                lambda s, b: strategy.run(donated_run, args=(s, b), options=donate), run_state, batch_20
            ),
            DONATED_CALLS,
        ),
    }


def check_no_recompiles(compiles: collections.Counter[str]) -> None:
    """Exit non-zero unless every step was traced exactly once and nothing compiled while timed."""
    print("traces: " + ", ".join(f"{variant}={count}" for variant, count in sorted(TRACES.items())))
    bad = {variant: count for variant, count in TRACES.items() if count != 1}
    if len(TRACES) != 6 or bad or compiles["backend"]:
        sys.exit(
            f"FAIL: a step was recompiled (traces other than 1: {bad}; XLA compiles while timed: "
            f"{compiles['backend']}), so the timings include compilation."
        )
    print("OK: each step function was traced exactly once; no XLA compile while timed.")


def main() -> None:
    rounds = parse_rounds(__doc__.splitlines()[0], full=FULL_ROUNDS, quick=QUICK_ROUNDS)
    strategy = jaxstrategy.OneDeviceStrategy()
    loops = build_loops(strategy)
    # Compile everything first; the listener then catches any compile during timing.
    for jit_loop, run_loop, _ in loops.values():
        jit_loop(WARMUP_CALLS)
        run_loop(WARMUP_CALLS)
    compiles = count_compiles()
    print(
        f"jax {jax.__version__} on {strategy.device}; {rounds} rounds of "
        f"{SPEC_CALLS} (spec) / {SGD_CALLS} (sgd, donated) calls per variant\n"
    )
    results = [measure(name, *loop, rounds) for name, loop in loops.items()]
    ratios = print_table(results, ("jit", "run"))
    print()
    check_no_recompiles(compiles)
    met = all(
        ratio <= GOAL_RATIO
        for result, ratio in zip(results, ratios, strict=True)
        if result.name in GOAL_CASES
    )
    print(f"goal ratio <= {GOAL_RATIO:.2f} in the spec loop and the sgd step: {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
