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

Then, at scale: jobs of 2, 4 and 8 processes (one CPU device each) run the same small
training loop (a linear model, its gradients all-reduced, fed by `distribute_datasets_from_function`),
and count the library's own calls to JAX's coordination service (`coordination.count_operations`,
which sees every call, since all go through `cluster/coordination.py`), summed over the job:

- input with a len(): calls per pass, from passes of S and 2S steps, and per step (their
  difference over S: 0 when nothing is spent per step);
- input without a len() (a generator): calls per step;
- the program check: calls per step over the run calls, and what `run` pays for it, in µs per
  call, measured by timing the check's own hook over 20 rounds;
- job_exits: calls per second (its watchers poll on a clock, not per step);
- time per step, with and without a len(). Eight processes share this machine's two cores: the
  times are reported, not judged.

    python bench/multi_worker.py            # the full benchmark
    python bench/multi_worker.py --quick    # a smoke test: one round, few calls, jobs of 2 and 4
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
FULL = {"rounds": 5, "latency_calls": 200, "train_calls": 40, "scale_steps": 32, "scale_jobs": (2, 4, 8)}
QUICK = {"rounds": 1, "latency_calls": 5, "train_calls": 3, "scale_steps": 8, "scale_jobs": (2, 4)}
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


def scale_worker(steps: int) -> None:
    """One process of a job at scale: count the coordination calls of one training loop."""
    import jax
    import jax.numpy as jnp

    import jaxstrategy
    from jaxstrategy._src.cluster import coordination
    from jaxstrategy._src.cluster.program_agreement import CALLS_PER_ROUND

    strategy = jaxstrategy.MultiWorkerMirroredStrategy(heartbeat_timeout_seconds=30)
    counts = coordination.count_operations()
    started_at = time.monotonic()
    rng = np.random.default_rng(jax.process_index())
    batches = [(rng.normal(size=(16, 8)).astype(np.float32),) * 2 for _ in range(2 * steps)]

    def train_step(w: jax.Array, batch: Any) -> tuple[jax.Array, jax.Array]:
        x, y = batch
        loss, grad = jax.value_and_grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
        grad, loss = jaxstrategy.get_replica_context().all_reduce("mean", (grad, loss))
        return w - 0.01 * grad, loss

    w = strategy.put(jnp.zeros((8, 8), jnp.float32))

    def one_pass(source_steps: int, with_len: bool) -> tuple[int, int, float]:
        nonlocal w
        mine = batches[:source_steps]
        dataset = strategy.distribute_datasets_from_function(
            lambda context: mine if with_len else (b for b in mine)
        )
        before_input, before_programs = counts.total("input"), counts.total("programs")
        started = time.perf_counter()
        for batch in dataset:
            w, loss = strategy.run(train_step, args=(w, batch))
        float(loss)
        seconds = time.perf_counter() - started
        return counts.total("input") - before_input, counts.total("programs") - before_programs, seconds

    one_pass(steps, True)  # Compiles.
    short, _, _ = one_pass(steps, True)
    long_input, long_programs, long_s = one_pass(2 * steps, True)
    generator_input, generator_programs, generator_s = one_pass(2 * steps, False)
    # What run pays for the program check: its hook alone, over 20 rounds with the others.
    hook_calls = 20 * CALLS_PER_ROUND
    assert strategy._job.program_agreement is not None
    started = time.perf_counter()
    for _ in range(hook_calls):
        strategy._job.program_agreement.record(train_step)
    hook_us = (time.perf_counter() - started) / hook_calls * 1e6
    result = {
        "input_per_pass": short,
        "input_per_step_with_len": (long_input - short) / steps,
        "input_per_step_without_len": generator_input / (2 * steps),
        "programs_per_step": (long_programs + generator_programs) / (4 * steps),
        "program_hook_us": hook_us,
        "ended_per_s": counts.total("ended") / (time.monotonic() - started_at),
        "step_ms_with_len": long_s / (2 * steps) * 1e3,
        "step_ms_without_len": generator_s / (2 * steps) * 1e3,
        "by_kind": counts.snapshot(),
    }
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def run_scale(num_processes: int, steps: int) -> dict[str, Any]:
    """A job of `num_processes` at scale: the sums over its processes (times: the slowest's)."""
    from jaxstrategy.testing import run_local_workers

    results = run_local_workers(
        [__file__, "--scale-worker", str(steps)], num_processes, devices_per_worker=1, timeout=TIMEOUT_S
    )
    if any(result.returncode for result in results):
        from jaxstrategy._src.cluster.local_workers import describe_results

        sys.exit(f"FAIL: a worker failed:\n{describe_results(results)}")
    found = []
    for result in results:
        (line,) = [line for line in result.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        found.append(json.loads(line.removeprefix(RESULT_PREFIX)))
    summed = {
        key: sum(f[key] for f in found) for key in found[0] if key.startswith(("input", "programs", "ended"))
    }
    for key in ("program_hook_us", "step_ms_with_len", "step_ms_without_len"):
        summed[key] = max(f[key] for f in found)
    return summed


def print_scale(settings: dict[str, Any]) -> None:
    steps = settings["scale_steps"]
    jobs = {n: run_scale(n, steps) for n in settings["scale_jobs"]}
    print(f"\nat scale: coordination calls summed over the job; passes of {steps} and {2 * steps} steps\n")
    print(f"{'processes':<44}" + "".join(f"{n:>10}" for n in jobs))
    for key, label, digits in (
        ("input_per_pass", "input with a len(), calls per pass", 0),
        ("input_per_step_with_len", "input with a len(), calls per step", 1),
        ("input_per_step_without_len", "input without a len(), calls per step", 1),
        ("programs_per_step", "program check, calls per step", 2),
        ("program_hook_us", "program check, us per run call (amortized)", 2),
        ("ended_per_s", "job_exits, calls per second", 1),
        ("step_ms_with_len", "step time with a len(), ms", 2),
        ("step_ms_without_len", "step time without a len(), ms", 2),
    ):
        print(f"{label:<44}" + "".join(f"{job[key]:>10.{digits}f}" for job in jobs.values()))
    if any(job["input_per_step_with_len"] != 0 for job in jobs.values()):
        sys.exit("FAIL: a source with a len() cost calls to the coordination service per step.")
    print("times: every process shares this machine's two cores; reported, not judged")


def run_layout(num_processes: int, devices: int, settings: dict[str, Any]) -> dict[str, Any]:
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
    parser.add_argument("--scale-worker", type=int, metavar="STEPS", help=argparse.SUPPRESS)
    parser.add_argument("--scale-only", action="store_true", help="only the jobs of 2, 4 and 8 processes")
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.scale_worker:
        scale_worker(args.scale_worker)
        return
    settings = QUICK if args.quick else FULL
    if args.scale_only:
        print_scale(settings)
        return
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
    print_scale(settings)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_util, input_pipeline
    main()
