"""Measure ShardedStrategy: bytes of state per device and step time, against MirroredStrategy, a
hand-written `jax.jit` of the same layout, and Keras 3's `ModelParallel`.

The script forces four CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=4`) before
JAX starts, unless XLA_FLAGS already forces a count. The model: 4 dense layers of 2048 x 2048
with biases (ReLU between them), MSE loss, Adam(1e-3), a global batch of 64: 64 MiB of
parameters, 192 MiB of state with Adam's two moments. Every loop donates its parameters and
optimizer state, as Keras's own step does (with donation, the outputs reuse the arguments'
buffers, so arguments plus temporaries is what a step holds).

* Sharded (R,S): `ShardedStrategy(num_replicas=R)` for (R,S) = (4,1), (2,2), (1,4), the state
  made by `strategy.init`, the batches from `strategy.experimental_distribute_dataset` (which
  splits each global batch over the replicas, each replica's part whole on its S devices, as
  Keras lays a batch out over its 'model' axis).
* jit: what a JAX user writes by hand: `jax.jit` with the kernels laid out by the specs that
  `ShardedStrategy.layout_of` gives (P('shard', None)) on a 1 x 4 mesh ('replica', 'shard'), the
  rest replicated, and the batch whole on every device.
* jit, batch split: the same, the batch split over the 4 devices (FSDP's layout). It shows what
  ShardedStrategy's first cut did, and why it no longer does: XLA then gathers every kernel and
  all-reduces every whole gradient (no reduce-scatter on CPU), 5x slower here.
* Mirrored: `MirroredStrategy` over the 4 devices, for reference.
* Keras ModelParallel: Keras 3 on JAX, `DeviceMesh((1, 4), ('batch', 'model'))` and a `LayoutMap`
  mapping '.*kernel' to ('model', None), the same split as ours, through `model.fit`. Skipped,
  with a line saying so, when keras is not installed (`pip install -e '.[bench]'`).

It reports, per case: the state (parameters and optimizer state) per device, from the arrays'
shards (the most any device holds); arguments plus temporaries per device from XLA's
`memory_analysis()` of the compiled step; the step time; and the collectives XLA put in each
program, to say where time goes. Rounds run one epoch of `--steps` batches of every case, in an
order that rotates from round to round; ratios are medians over rounds of the per-round ratio
(see bench_util.py). It draws bytes per device and step time against S beside Mirrored and Keras
to docs/_static/sharded.png. It exits non-zero if a step was traced more than once or XLA
compiled while timed.

Then the job rows (`sharded_job.py`): `MultiWorkerShardedStrategy(num_replicas=R)` over a job of
2 processes x 2 CPU devices on this machine (`run_local_workers`' environment: TF_CONFIG on
127.0.0.1, gloo over TCP between the processes), for (R,S) = (2,2) (a replica in each process)
and (1,4) (one replica over both), against `ShardedStrategy(num_replicas=R)` over 4 CPU devices
of this one process, the same model (a smaller one with --quick) and batches. The reference runs
in this process and the job in its two, in lockstep, never at once: 10 rounds (2 with --quick)
rotate over the four cases as above, then 3 rounds (1) of checkpoints; every ratio is the median
of the per-round ratios (job / one process).

* state/device: per layout, what each job process's most loaded device holds (from its arrays'
  addressable shards; each process reports its own), and the same in one process.
* ms/step: an epoch of 5 batches (2 with --quick) through `run`, per step; the job's is the
  slower process's.
* save: `checkpoint.save(directory, state, step=0)`, which returns when the step is on disk.
* restore: `checkpoint.restore(directory, strategy=..., target=state)` onto the layout (checksums
  checked), until the arrays are ready; and, crossed, the other layout's checkpoint onto this one.
* read: the bytes each process read during the restore, the delta of `rchar` in /proc/self/io
  (skipped, with a line saying so, where there is none), against the step's bytes on disk: about
  half each for (1,4), whose processes hold half the state each; all of it for (2,2), whose
  processes hold a whole replica each.

NCCL rows need a machine with two or more GPUs; without one a line says they are skipped.

    python bench/sharded.py            # the full benchmark (with keras: pip install -e '.[bench]')
    python bench/sharded.py --quick    # a smoke test: small layers, few steps, the plot to a temp dir
    python bench/sharded.py --job-only # only the job rows
"""

from __future__ import annotations

import os
import re

from cpu_devices import force_cpu_devices

force_cpu_devices(4)
# Keras picks its backend when first imported; the comparison is with Keras on JAX.
os.environ["KERAS_BACKEND"] = "jax"

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import sharded_job  # noqa: E402
from bench_util import count_compiles, state_bytes_per_device  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jaxstrategy  # noqa: E402

LAYERS = 4
FULL = {"hidden": 2048, "batch": 64, "steps": 5, "rounds": 15}
# Kernels of 512 x 512 (1 MiB) are still over min_shard_bytes, so they are split as the full ones.
QUICK = {"hidden": 512, "batch": 16, "steps": 2, "rounds": 2}
MESHES = ((4, 1), (2, 2), (1, 4))  # (R, S): S = 1, 2, 4
# The goals: state per device at most 1/S of Mirrored's + 5%; step time at most 1.05x
# the hand-written jit and Keras ModelParallel.
GOAL_STATE = 1.05
GOAL_STEP = 1.05
PLOT = Path(__file__).resolve().parents[1] / "docs" / "_static" / "sharded.png"

SHARDED_14 = "Sharded (1,4)"
JIT = "jit"
JIT_SPLIT = "jit, batch split"
MIRRORED = "Mirrored"
KERAS = "Keras ModelParallel"

TRACES: collections.Counter[str] = collections.Counter()
ADAM = optax.adam(1e-3)
MiB = 2**20


@dataclasses.dataclass
class Case:
    """One way to train: an epoch to time (seconds per step), the state it holds now, and how to
    compile its step; filled in as measured: state bytes per device, the compiled step, times."""

    epoch: Callable[[], float]
    state: Callable[[], Any]
    compile_step: Callable[[], Any]
    state_bytes: int = 0
    compiled: Any = None
    times: list[float] = dataclasses.field(default_factory=list)


def init_params(key: jax.Array, hidden: int) -> dict[str, Any]:
    keys = jax.random.split(key, LAYERS)
    return {
        f"dense{i}": {
            "kernel": jax.random.normal(k, (hidden, hidden)) * (2.0 / hidden) ** 0.5,
            "bias": jnp.zeros(hidden),
        }
        for i, k in enumerate(keys)
    }


def loss_fn(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
    h = x
    for i in range(LAYERS):
        h = h @ params[f"dense{i}"]["kernel"] + params[f"dense{i}"]["bias"]
        if i < LAYERS - 1:
            h = jax.nn.relu(h)
    return jnp.mean((h - y) ** 2)


def replica_step(case: str) -> Callable[..., Any]:
    """The step every strategy runs, the same code on MirroredStrategy and ShardedStrategy (one
    function object per case, to count each case's traces)."""

    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        TRACES[case] += 1
        grads = jax.grad(loss_fn)(params, *batch)
        grads = jaxstrategy.get_replica_context().all_reduce("mean", grads)
        updates, opt_state = ADAM.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def plain_step(case: str) -> Callable[..., Any]:
    """The hand-written step: grads, optax's update, apply."""

    def step(params: Any, opt_state: Any, x: jax.Array, y: jax.Array) -> Any:
        TRACES[case] += 1
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = ADAM.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def strategy_case(
    name: str,
    strategy: jaxstrategy.MirroredStrategy | jaxstrategy.ShardedStrategy,
    batches: list[Any],
    hidden: int,
) -> Case:
    params = strategy.init(init_params, jax.random.key(0), hidden)
    carried = [(params, strategy.init(ADAM.init, params))]
    dataset = strategy.experimental_distribute_dataset(batches)
    donate = jaxstrategy.RunOptions(donate_argnums=(0, 1))
    step = replica_step(name)

    def epoch() -> float:
        start = time.perf_counter()
        for batch in dataset:
            carried[0] = strategy.run(step, args=(*carried[0], batch), options=donate)
        jax.block_until_ready(carried[0])
        return (time.perf_counter() - start) / len(batches)

    def compile_step() -> Any:
        # The step compiled under an outer jax.jit that donates, as run's does (run works under
        # one), rather than taken from run's private cache of jits. Under an outer jit, run sees
        # tracers, not where the arrays are: it reuses the jit of its last call of `step` with the
        # same options, else lays the inputs out by its rules. So first one call without
        # options, the arrays placed as timed. Checked on this model, without donation: the same
        # arguments, temporaries and collectives as the jit in run's cache.
        batch = next(iter(dataset))
        strategy.run(step, args=(*carried[0], batch))
        outer = jax.jit(lambda p, s, b: strategy.run(step, args=(p, s, b)), donate_argnums=(0, 1))
        return outer.lower(*carried[0], batch).compile()

    return Case(epoch, lambda: carried[0], compile_step)


def jit_case(
    name: str, layout_of: Callable[[Any], Any], batches: list[Any], hidden: int, *, whole_batch: bool
) -> Case:
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:4]).reshape(1, 4), ("replica", "shard"))
    params = init_params(jax.random.key(0), hidden)
    state = (params, ADAM.init(params))
    # ShardedStrategy's specs, on this mesh: P('shard', None) for the kernels, P() for the rest.
    layout = jax.tree.map(lambda sharding: NamedSharding(mesh, sharding.spec), layout_of(state))
    data = NamedSharding(mesh, P() if whole_batch else P(("replica", "shard")))
    step = jax.jit(
        plain_step(name), in_shardings=(*layout, data, data), out_shardings=layout, donate_argnums=(0, 1)
    )
    carried = [jax.device_put(state, layout)]

    def epoch() -> float:
        start = time.perf_counter()
        for batch in batches:
            x, y = jax.device_put(batch, data)
            carried[0] = step(*carried[0], x, y)
        jax.block_until_ready(carried[0])
        return (time.perf_counter() - start) / len(batches)

    def compile_step() -> Any:
        return step.lower(*carried[0], *jax.device_put(batches[0], data)).compile()

    return Case(epoch, lambda: carried[0], compile_step)


def keras_importable() -> bool:
    try:
        import keras  # noqa: F401
    except ImportError:
        return False
    return True


def keras_case(batches: list[Any], hidden: int) -> Case:
    import keras

    mesh = keras.distribution.DeviceMesh((1, 4), ("batch", "model"), devices=jax.devices()[:4])
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*kernel"] = ("model", None)  # Split as ours: along the kernel's first axis.
    distribution = keras.distribution.ModelParallel(layout_map=layout_map, batch_dim_name="batch")
    keras.distribution.set_distribution(distribution)
    keras.utils.set_random_seed(0)
    layers = [keras.layers.Dense(hidden, activation="relu") for _ in range(LAYERS - 1)]
    model = keras.Sequential([keras.Input((hidden,)), *layers, keras.layers.Dense(hidden)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x = np.concatenate([x for x, _ in batches])
    y = np.concatenate([y for _, y in batches])
    batch_size = len(batches[0][0])

    def epoch() -> float:
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / len(batches)

    def state() -> Any:
        return [v.value for v in (*model.variables, *model.optimizer.variables)]

    def compile_step() -> Any:
        # Keras's own train step, donating its state as `fit` does, with the batch where `fit`
        # puts it (split over 'batch', of one device: whole on each device of 'model').
        keras_state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in model.optimizer.variables],
            [v.value for v in model.metrics_variables],
        )
        where = distribution.get_data_layout(batches[0][0].shape).backend_layout
        data = jax.device_put(batches[0], where)
        return jax.jit(model.train_step, donate_argnums=0).lower(keras_state, data).compile()

    return Case(epoch, state, compile_step)


_COLLECTIVE = re.compile(
    r"= (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)
_ARRAY_TYPE = re.compile(r"\b(f32|s32|u32|f16|bf16|pred)\[([\d,]*)\]")
# Copies XLA added, alone or fused with other work (a layout change, or a buffer it cannot reuse).
_COPY = re.compile(r"= \S+ copy\(|%\S*copy\S* = ")
_ITEM_BYTES = {"f32": 4, "s32": 4, "u32": 4, "f16": 2, "bf16": 2, "pred": 1}


def collectives(hlo: str) -> tuple[collections.Counter[str], int]:
    """The collectives in an optimized HLO module, by kind, and the bytes of their results per
    device (what each device receives, about)."""
    kinds: collections.Counter[str] = collections.Counter()
    received = 0
    for result_type, kind in _COLLECTIVE.findall(hlo):
        kinds[kind] += 1
        for dtype, dims in _ARRAY_TYPE.findall(result_type):
            received += _ITEM_BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d]))
    return kinds, received


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke test: small layers, few steps")
    parser.add_argument("--rounds", type=int, help="rounds (default 15; 2 with --quick)")
    parser.add_argument("--steps", type=int, help="steps per epoch (default 5; 2 with --quick)")
    parser.add_argument("--plot", type=Path, help=f"where to draw the figure (default {PLOT})")
    parser.add_argument("--job-only", action="store_true", help="only the 2-process job's rows")
    parser.add_argument("--job-worker", type=Path, metavar="CONTROL_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    args.hidden, args.batch = sizes["hidden"], sizes["batch"]
    args.rounds = args.rounds or sizes["rounds"]
    args.steps = args.steps or sizes["steps"]
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    return args


def main() -> None:
    args = parse_args()
    if args.job_worker:
        sharded_job.worker(args.job_worker, strategy_case, TRACES)
        return
    if len(jax.devices()) < 4:
        sys.exit(f"FAIL: found {len(jax.devices())} devices; XLA_FLAGS must force 4 CPU devices.")
    ok = args.job_only or one_process(args)
    # After the one-process rows, whose states are freed by now.
    ok = sharded_job.section(args.quick, strategy_case, TRACES) and ok
    if not ok:
        sys.exit("FAIL: a step was traced more than once, or XLA compiled while timed.")


def one_process(args: argparse.Namespace) -> bool:
    """The one-process rows; return True when no step was retraced and XLA compiled nothing
    while timed."""
    devices = jax.devices()[:4]
    rng = np.random.default_rng(0)
    batches = [
        tuple(rng.normal(size=(args.batch, args.hidden)).astype(np.float32) for _ in range(2))
        for _ in range(args.steps)
    ]
    sharded = {shape: jaxstrategy.ShardedStrategy(devices, num_replicas=shape[0]) for shape in MESHES}
    cases = {}
    for r, s in MESHES:
        name = f"Sharded ({r},{s})"
        cases[name] = strategy_case(name, sharded[r, s], batches, args.hidden)
    cases[JIT] = jit_case(JIT, sharded[1, 4].layout_of, batches, args.hidden, whole_batch=True)
    cases[JIT_SPLIT] = jit_case(JIT_SPLIT, sharded[1, 4].layout_of, batches, args.hidden, whole_batch=False)
    mirrored = jaxstrategy.MirroredStrategy(devices)
    cases[MIRRORED] = strategy_case(MIRRORED, mirrored, batches, args.hidden)
    has_keras = keras_importable()
    if has_keras:
        cases[KERAS] = keras_case(batches, args.hidden)

    for case in cases.values():  # Compile, and fill caches, outside the timing.
        case.epoch()
    compiles = count_compiles()
    names = list(cases)
    for round_index in range(args.rounds):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            cases[name].times.append(cases[name].epoch())
    timed_compiles = compiles["backend"]
    traces = dict(sorted(TRACES.items()))
    for case in cases.values():
        case.state_bytes = state_bytes_per_device(case.state())
        case.compiled = case.compile_step()

    report(cases, args, has_keras)
    draw(cases, args)
    print(f"\ntraces: {traces}; XLA compiles while timed: {timed_compiles}")
    return all(count == 1 for count in traces.values()) and not timed_compiles


def mib(size: float) -> str:
    return f"{size / MiB:.1f} MiB"


def mib_of(size: float) -> float:
    return size / MiB


def step_bytes(case: Case) -> int:
    """The compiled step's arguments plus temporaries per device."""
    memory = case.compiled.memory_analysis()
    return int(memory.argument_size_in_bytes + memory.temp_size_in_bytes)


def ratio(case: Case, base: Case) -> float:
    return statistics.median(a / b for a, b in zip(case.times, base.times, strict=True))


def report(cases: dict[str, Case], args: argparse.Namespace, has_keras: bool) -> None:
    state_mib = (LAYERS * (args.hidden + 1) * args.hidden * 4 * 3) / MiB
    print(
        f"jax {jax.__version__}; 4 CPU devices on {os.cpu_count()} cores; {LAYERS} dense layers of "
        f"{args.hidden}x{args.hidden}, Adam, batch {args.batch} ({state_mib:.1f} MiB of state); "
        f"{args.rounds} rounds of {args.steps} steps per case"
    )
    if not has_keras:
        print("keras is not installed: its rows are skipped (pip install -e '.[bench]').")
    keras_case = cases.get(KERAS)
    header = f"{'case':<28}{'state/device':>14}{'args+temp':>12}{'ms/step (p10-p90)':>24}{'vs jit':>9}"
    print("\n" + header + (f"{'vs keras':>10}" if keras_case else ""))
    for name, case in cases.items():
        used = step_bytes(case)
        p10, p50, p90 = np.percentile(np.asarray(case.times) * 1e3, [10, 50, 90])
        line = f"{name:<28}{mib(case.state_bytes):>14}{mib(used):>12}"
        line += f"{f'{p50:.1f} ({p10:.1f}-{p90:.1f})':>24}{ratio(case, cases[JIT]):>9.3f}"
        print(line + (f"{ratio(case, keras_case):>10.3f}" if keras_case else ""))
    print(
        "state/device: parameters and optimizer state, the most any device holds (from the arrays' "
        "shards); args+temp: the compiled step's arguments plus temporaries per device (XLA's "
        "memory_analysis); ratios: median over rounds of the per-round ratio (below 1: faster)."
    )

    print(
        f"\n{'compiled step':<28}{'all-gather':>11}{'all-reduce':>11}{'red-scatter':>12}"
        f"{'all-to-all':>11}{'received':>12}{'args':>12}{'temp':>12}{'copies':>8}"
    )
    for name, case in cases.items():
        hlo = case.compiled.as_text()
        kinds, received = collectives(hlo)
        memory = case.compiled.memory_analysis()
        counts = "".join(
            f"{kinds[kind]:>{width}}"
            for kind, width in (
                ("all-gather", 11),
                ("all-reduce", 11),
                ("reduce-scatter", 12),
                ("all-to-all", 11),
            )
        )
        sizes = (
            f"{mib(received):>12}{mib(memory.argument_size_in_bytes):>12}{mib(memory.temp_size_in_bytes):>12}"
        )
        print(f"{name:<28}{counts}{sizes}{len(_COPY.findall(hlo)):>8}")
    print(
        "received: the bytes of the collectives' results per device and step; copies: copy "
        "instructions and fusions named for one."
    )

    print()
    mirrored = cases[MIRRORED].state_bytes
    for r, s in MESHES:
        share = cases[f"Sharded ({r},{s})"].state_bytes / (mirrored / s)
        verdict = "met" if share <= GOAL_STATE else "NOT met"
        print(
            f"goal state per device of Sharded ({r},{s}) <= 1/{s} of Mirrored's + 5%: {verdict} ({share:.3f})"
        )
    goals = [(JIT, cases[JIT])] + ([(KERAS, keras_case)] if keras_case else [])
    for name, base in goals:
        value = ratio(cases[SHARDED_14], base)
        verdict = "met" if value <= GOAL_STEP else "NOT met"
        print(f"goal step time {SHARDED_14}/{name} <= {GOAL_STEP}: {verdict} ({value:.3f})")
    if not keras_case:
        print(f"goal step time {SHARDED_14}/{KERAS} <= {GOAL_STEP}: skipped (no keras)")


def draw(cases: dict[str, Case], args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if args.plot is None and args.quick:
        path = Path(tempfile.mkdtemp()) / "sharded.png"
    else:
        path = args.plot or PLOT
    shards = [s for _, s in MESHES]
    sharded = [cases[f"Sharded ({r},{s})"] for r, s in MESHES]
    figure, (memory_axes, time_axes) = plt.subplots(1, 2, figsize=(10, 5.2))
    memory_axes.plot(shards, [mib_of(c.state_bytes) for c in sharded], "o-", label="ShardedStrategy: state")
    memory_axes.plot(
        shards, [mib_of(step_bytes(c)) for c in sharded], "o--", label="ShardedStrategy: step's args + temp"
    )
    medians, p10, p90 = (np.asarray([np.percentile(c.times, q) * 1e3 for c in sharded]) for q in (50, 10, 90))
    time_axes.errorbar(
        shards, medians, yerr=(medians - p10, p90 - medians), fmt="o-", capsize=3, label="ShardedStrategy"
    )
    # Mirrored does not depend on S: a line. The others are at S = 4: points, set apart a little.
    memory_axes.axhline(
        mib_of(cases[MIRRORED].state_bytes), linestyle=":", color="gray", label="Mirrored: state"
    )
    memory_axes.axhline(
        mib_of(step_bytes(cases[MIRRORED])),
        linestyle="-.",
        color="gray",
        label="Mirrored: step's args + temp",
    )
    time_axes.axhline(np.median(cases[MIRRORED].times) * 1e3, linestyle=":", color="gray", label=MIRRORED)
    points = [(JIT, "s", "hand-written jax.jit"), (JIT_SPLIT, "^", "hand-written jax.jit, batch split")]
    points += [(KERAS, "D", KERAS)] if KERAS in cases else []
    for offset, (name, marker, label) in zip((-0.1, 0.1, 0.2), points, strict=False):
        time_axes.plot([4 + offset], [np.median(cases[name].times) * 1e3], marker, label=label)
        if name != JIT:  # The jit's memory is Sharded (1,4)'s (they compile to the same program).
            memory_axes.plot(
                [4 + offset], [mib_of(step_bytes(cases[name]))], marker, label=f"{label}: args + temp"
            )
    memory_axes.set(xlabel="S, devices per replica (R = 4 / S)", ylabel="MiB per device", xticks=shards)
    memory_axes.set(title="memory per device", ylim=(0, None))
    time_axes.set(xlabel="S, devices per replica (R = 4 / S)", ylabel="ms per step (median, p10-p90)")
    time_axes.set(title=f"step time, batch {args.batch}", xticks=shards, ylim=(0, None))
    for axes in (memory_axes, time_axes):
        axes.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    figure.suptitle(f"{LAYERS} dense layers of {args.hidden}x{args.hidden}, 4 CPU devices", fontsize=9)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
