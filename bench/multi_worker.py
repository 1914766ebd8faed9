"""Measure MultiWorkerMirroredStrategy: 1 process x 2 devices against 2 processes x 1 device.

Both layouts run the same code on two replicas through `MultiWorkerMirroredStrategy`; only the
processes differ. Each round starts one job of each layout on this machine (with
`jaxstrategy.testing.run_local_workers`, alternating which goes first), and each job measures,
after a warm-up:

1. all-reduce latency: `run` of a step that only all-reduces (SUM) a float32[1], and a 4 MiB
   float32 array, waiting for each call: the round trip a training step adds to gradients;
2. training step: the flax nnx MLP 784-512-512-10 with adam and a global batch of 128 (the input
   pipeline benchmark's workload) through `run`, the batch placed before timing.

Within a process XLA's CPU client communicates through shared memory; between processes, gloo
over TCP on 127.0.0.1. Both layouts share this machine's cores, so this shows what crossing
processes costs, not a speed-up. The table gives per-call medians over the rounds and the median
of the per-round ratios (2 processes / 1 process).

    python bench/multi_worker.py            # the full benchmark
    python bench/multi_worker.py --quick    # a smoke test: one round, few calls
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

LAYOUTS = {"1 process x 2 devices": (1, 2), "2 processes x 1 device": (2, 1)}
FULL = {"rounds": 5, "latency_calls": 200, "train_calls": 40}
QUICK = {"rounds": 1, "latency_calls": 5, "train_calls": 3}
TIMEOUT_S = 600
RESULT_PREFIX = "RESULT "


def worker(latency_calls: int, train_calls: int) -> None:
    """One process of a job: measure, and print the results from process 0 as JSON."""
    import jax
    import optax
    from flax import nnx
    from input_pipeline import MLP, random_batch

    import jaxstrategy

    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    traces: dict[str, int] = {}

    def total(x: jax.Array) -> jax.Array:
        name = f"all_reduce{list(x.shape)}"  # One trace per shape.
        traces[name] = traces.get(name, 0) + 1
        return jaxstrategy.get_replica_context().all_reduce("sum", x)

    def latency(value: np.ndarray) -> float:
        placed = strategy.put(value)
        for _ in range(3):
            jax.block_until_ready(strategy.run(total, args=(placed,)))
        started = time.perf_counter()
        for _ in range(latency_calls):
            jax.block_until_ready(strategy.run(total, args=(placed,)))
        return (time.perf_counter() - started) / latency_calls

    graphdef, params = nnx.split(MLP(nnx.Rngs(0)))
    optimizer = optax.adam(1e-3)

    def train_step(state: Any, batch: Any) -> Any:
        traces["train"] = traces.get("train", 0) + 1
        params, opt_state = state

        def loss_fn(params: Any) -> jax.Array:
            logits = nnx.merge(graphdef, params)(batch[0])
            return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        grads, loss = jaxstrategy.get_replica_context().all_reduce("mean", (grads, loss))
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    with jax.numpy_dtype_promotion("standard"):
        small, large = latency(np.ones(1, np.float32)), latency(np.ones(1 << 20, np.float32))
        state = strategy.put((params, optimizer.init(params)))
        batch = next(iter(strategy.experimental_distribute_dataset([random_batch(np.random.default_rng(1))])))
        for _ in range(3):
            state, loss = strategy.run(train_step, args=(state, batch))
        jax.block_until_ready(loss)
        started = time.perf_counter()
        for _ in range(train_calls):
            state, loss = strategy.run(train_step, args=(state, batch))
        jax.block_until_ready(loss)
        train = (time.perf_counter() - started) / train_calls
    if jax.process_index() == 0:
        result = {"small": small, "large": large, "train": train, "traces": traces}
        print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_layout(num_processes: int, devices: int, settings: dict[str, int]) -> dict[str, Any]:
    from jaxstrategy.testing import run_local_workers

    args = [__file__, "--worker", str(settings["latency_calls"]), str(settings["train_calls"])]
    results = run_local_workers(args, num_processes, devices_per_worker=devices, timeout=TIMEOUT_S)
    if any(result.returncode for result in results):
        from jaxstrategy._src.cluster.local_workers import describe_results

        sys.exit(f"FAIL: a worker failed:\n{describe_results(results)}")
    (line,) = [line for line in results[0].stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    return json.loads(line.removeprefix(RESULT_PREFIX))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: one round, few calls")
    parser.add_argument(
        "--worker", nargs=2, type=int, metavar=("LATENCY_CALLS", "TRAIN_CALLS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    settings = QUICK if args.quick else FULL
    rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in LAYOUTS}
    for round_index in range(settings["rounds"]):
        order = list(LAYOUTS) if round_index % 2 == 0 else list(reversed(LAYOUTS))
        for name in order:
            rounds[name].append(run_layout(*LAYOUTS[name], settings))
    one, two = (rounds[name] for name in LAYOUTS)
    print(f"{settings['rounds']} rounds; two replicas in each layout; per-call medians\n")
    print(f"{'case':<28}{'1 process x 2 devices':>24}{'2 processes x 1 device':>26}{'ratio 2p/1p':>14}")
    for key, label, unit, scale in (
        ("small", "all-reduce float32[1]", "us", 1e6),
        ("large", "all-reduce 4 MiB", "ms", 1e3),
        ("train", "training step", "ms", 1e3),
    ):
        a = statistics.median(r[key] for r in one) * scale
        b = statistics.median(r[key] for r in two) * scale
        ratio = statistics.median(y[key] / x[key] for x, y in zip(one, two, strict=True))
        print(f"{label:<28}{f'{a:.1f} {unit}':>24}{f'{b:.1f} {unit}':>26}{ratio:>14.2f}")
    traces = [r["traces"] for r in one + two]
    print(f"\ntraces per job: {traces[0]}")
    if any(count != 1 for t in traces for count in t.values()):
        sys.exit("FAIL: a step was traced more than once.")
    print("no goal: this records what crossing processes costs on this machine")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_util, input_pipeline
    main()
