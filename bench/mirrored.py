"""Measure MirroredStrategy: what `run` costs over a bare `jax.jit` of the same `shard_map`, and
what a second device gives a training step.

The script forces two CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`) before
JAX starts, unless XLA_FLAGS already forces a count.

1. Dispatch, on MirroredStrategy over both devices. Each case is timed once through
   `strategy.run(fn, args=...)` and once through what a JAX user would write by hand:
   `jax.jit(jax.shard_map(fn, mesh=strategy.mesh, in_specs=..., out_specs=...))` (with
   `check_vma=False` where it takes gradients, for each replica's own, as `run` gives), called
   with the same replicated parameters and the same batch sharded over the replicas.

   * spec loop (int): `step_fn(x) = x * 2` with a new Python int each call.
   * sgd step (tree): one SGD step of a small MLP on a per-replica batch, gradients and loss
     averaged across replicas with `pmean` (through the replica context for `run`).

2. Training, the flax nnx MLP 784-512-512-10 with adam and a global batch of 128 (the input
   pipeline benchmark's workload), through `strategy.run` on `OneDeviceStrategy` against
   `MirroredStrategy` over two devices: the same code, the batch placed before timing. Both
   devices share this machine's cores, so this shows the cost of splitting, not a speed-up.

On CPU devices `run` waits for every 8th step to finish (XLA's CPU client can deadlock with many
multi-device steps in flight), so the hand-written loops do the same.

Rounds time a batch of calls of each variant side by side, alternating which goes first; the
tables give per-call medians and the median of the per-round ratios (see bench_util.py). The
script exits non-zero if a step was traced more than once or XLA compiled while timed.

    python bench/mirrored.py            # the full benchmark
    python bench/mirrored.py --quick    # a smoke test with a few rounds
"""

from __future__ import annotations

import os

from cpu_devices import force_cpu_devices

force_cpu_devices(2)

import collections  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from bench_util import (  # noqa: E402
    Loop,
    count_compiles,
    int_loop,
    measure,
    parse_rounds,
    print_table,
    training_loop,
)
from flax import nnx  # noqa: E402
from input_pipeline import MLP, random_batch  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxstrategy  # noqa: E402
from jaxstrategy._src.strategies.mesh_replicas import CPU_STEPS_IN_FLIGHT  # noqa: E402

GOAL_RATIO = 1.10
FULL_ROUNDS, QUICK_ROUNDS = 30, 3
SPEC_CALLS, SGD_CALLS, TRAIN_CALLS = 500, 200, 20
WARMUP_CALLS = 20

# MirroredStrategy.run waits for every 8th step on CPU devices, because XLA's CPU client can
# deadlock with many multi-device steps in flight; the hand-written loops wait as often, or they
# could hang.
HAND_WRITTEN_WAIT_EVERY = CPU_STEPS_IN_FLIGHT

TRACES: collections.Counter[str] = collections.Counter()


def spec_step(variant: str) -> Callable[[Any], Any]:
    def step_fn(x):
        TRACES[variant] += 1
        return x * 2

    return step_fn


def sgd_step(variant: str, mean_across_replicas: Callable[[Any], Any]) -> Callable[[dict, Any], Any]:
    """One SGD step; `mean_across_replicas` averages over the replicas (pmean, or all_reduce)."""

    def loss_fn(params, x, y):
        hidden = jnp.tanh(x @ params["w1"] + params["b1"])
        return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)

    def step(params, batch):
        TRACES[variant] += 1
        loss, grads = jax.value_and_grad(loss_fn)(params, batch["x"], batch["y"])
        grads, loss = mean_across_replicas((grads, loss))
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    return step


def pmean(tree: Any) -> Any:
    return jax.lax.pmean(tree, "replica")


def all_reduce_mean(tree: Any) -> Any:
    return jaxstrategy.get_replica_context().all_reduce("mean", tree)


def dispatch_loops(strategy: jaxstrategy.MirroredStrategy) -> dict[str, tuple[Loop, Loop, int]]:
    mesh = strategy.mesh
    spec_jit = jax.jit(jax.shard_map(spec_step("spec/jit"), mesh=mesh, in_specs=P(), out_specs=P()))
    spec_run = spec_step("spec/run")

    rng = np.random.default_rng(0)
    params = {
        "w1": rng.normal(size=(8, 16)).astype(np.float32) * 0.3,
        "b1": np.zeros(16, np.float32),
        "w2": rng.normal(size=(16, 1)).astype(np.float32) * 0.3,
        "b2": np.zeros(1, np.float32),
    }
    x = rng.normal(size=(32, 8)).astype(np.float32)
    host_batch = {"x": x, "y": np.sin(x.sum(axis=1, keepdims=True))}
    replicated = strategy.put(params)
    # The hand-written program takes the global batch sharded along its first axis; run takes the
    # dataset's PerReplica batch. Both are placed before timing.
    sharded_batch = jax.device_put(host_batch, NamedSharding(mesh, P("replica")))
    per_replica_batch = next(iter(strategy.experimental_distribute_dataset([host_batch])))
    # check_vma=False, as run has it: with JAX's replication types on, the gradient of the
    # replicated parameters would come back summed over the replicas, not each replica's own.
    sgd_jit = jax.jit(
        jax.shard_map(
            sgd_step("sgd/jit", pmean),
            mesh=mesh,
            in_specs=(P(), P("replica")),
            out_specs=(P(), P()),
            check_vma=False,
        )
    )
    sgd_run = sgd_step("sgd/run", all_reduce_mean)
    return {
        "spec loop (int)": (
            # Both calls sit in a lambda, so neither pays for an extra Python frame alone.
            int_loop(lambda i: spec_jit(i), HAND_WRITTEN_WAIT_EVERY),
            int_loop(lambda i: strategy.run(spec_run, args=(i,))),
            SPEC_CALLS,
        ),
        "sgd step (tree)": (
            training_loop(lambda s, b: sgd_jit(s, b), replicated, sharded_batch, HAND_WRITTEN_WAIT_EVERY),
            training_loop(lambda s, b: strategy.run(sgd_run, args=(s, b)), replicated, per_replica_batch),
            SGD_CALLS,
        ),
    }


def training_step() -> tuple[Callable[[Any, Any], Any], Any]:
    """The workload as one `run`-able step of ((params, opt_state), batch), and its initial state."""
    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    optimizer = optax.adam(1e-3)

    def step(state, batch):
        TRACES[f"train/{jaxstrategy.get_strategy().num_replicas_in_sync}"] += 1
        params, opt_state = state
        x, y = batch

        def loss_fn(params):
            logits = nnx.merge(graphdef, params)(x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads, loss = all_reduce_mean((grads, loss))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return step, (params, optimizer.init(params))


def training_loops(mirrored: jaxstrategy.MirroredStrategy) -> tuple[Loop, Loop]:
    step, state = training_step()
    batch = random_batch(np.random.default_rng(1))
    loops = []
    for strategy in (jaxstrategy.OneDeviceStrategy(mirrored.devices[0]), mirrored):
        placed_batch = next(iter(strategy.experimental_distribute_dataset([batch])))
        run = strategy.run  # Bound once: both variants pay the same lookup.
        loops.append(
            training_loop(lambda s, b, run=run: run(step, args=(s, b)), strategy.put(state), placed_batch)
        )
    return loops[0], loops[1]


def main() -> None:
    rounds = parse_rounds(__doc__.splitlines()[0], full=FULL_ROUNDS, quick=QUICK_ROUNDS)
    strategy = jaxstrategy.MirroredStrategy()
    if strategy.num_replicas_in_sync < 2:
        sys.exit(f"FAIL: found {strategy.num_replicas_in_sync} device; XLA_FLAGS must force 2 CPU devices.")
    dispatch = dispatch_loops(strategy)
    one_device, two_devices = training_loops(strategy)
    with jax.numpy_dtype_promotion("standard"):
        for base, other, _ in dispatch.values():
            base(WARMUP_CALLS)
            other(WARMUP_CALLS)
        one_device(3)
        two_devices(3)
        compiles = count_compiles()
        print(f"jax {jax.__version__}; {strategy!r}; {os.cpu_count()} CPU cores; {rounds} rounds\n")
        print("1. run over a bare jax.jit of the same shard_map, on 2 replicas")
        results = [measure(name, *loops, rounds) for name, loops in dispatch.items()]
        ratios = print_table(results, ("jit", "run"))
        print("\n2. training step (MLP 784-512-512-10, adam, global batch 128), same code")
        training = measure("train step", one_device, two_devices, TRAIN_CALLS, rounds)
        (split_ratio,) = print_table([training], ("1 device", "2 devices"))
    print(f"\ntraces: {dict(sorted(TRACES.items()))}; XLA compiles while timed: {compiles['backend']}")
    if any(count != 1 for count in TRACES.values()) or compiles["backend"]:
        sys.exit("FAIL: a step was traced more than once, or XLA compiled while timed.")
    met = all(ratio <= GOAL_RATIO for ratio in ratios)
    print(f"goal run/jit <= {GOAL_RATIO:.2f} in both cases: {'met' if met else 'NOT met'}")
    print(f"2 devices take {split_ratio:.2f}x the step time of 1 device on {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
