"""What every process of a two-process `MultiWorkerShardedStrategy` job does for test_sharded_job.py.

    python tests/strategies/sharded_job_worker.py OUTPUT_DIR

Each process runs the same scenarios in the same order, as every program of a job must, and
writes what it saw to OUTPUT_DIR/process-<index>.json for the test to compare with one device.
"""

from __future__ import annotations

import json
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import jaxstrategy

sys.path.insert(0, str(Path(__file__).parent))
import sharded_nnx_scenario  # noqa: E402

# The test's model, batches and optimizer: the reference trains the same in one process.
BATCH = 12
STEPS = 4
MEGATRON = [("w1", P(None, "model")), ("b1", P("model")), ("w2", P("model", None))]


def initial_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "w1": (rng.normal(size=(8, 16)) * 0.4).astype(np.float32),
        "b1": rng.normal(size=16).astype(np.float32),
        "w2": (rng.normal(size=(16, 4)) * 0.4).astype(np.float32),
        "b2": rng.normal(size=4).astype(np.float32),
    }


def batches() -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(4)
    return [
        {
            "x": rng.normal(size=(BATCH, 8)).astype(np.float32),
            "y": rng.normal(size=(BATCH, 4)).astype(np.float32),
        }
        for _ in range(STEPS)
    ]


def optimizer() -> optax.GradientTransformation:
    # The threshold sits among the gradients' global norms (3.2 to 6.6 over the batches), so the
    # true norm decides which steps are clipped: a gradient summed over 2 replicas rather than
    # averaged is clipped at every step, and moves the parameters elsewhere.
    return optax.chain(optax.clip_by_global_norm(4.0), optax.sgd(0.1, momentum=0.9))


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array, constrain: Any) -> jax.Array:
    hidden = jax.nn.relu(constrain(x @ params["w1"] + params["b1"], (None, "model")))
    return jnp.mean((hidden @ params["w2"] + params["b2"] - y) ** 2)


def one_device_training() -> tuple[list[float], dict[str, np.ndarray]]:
    """The reference: the same training by a plain `jax.jit` loop on one device, on each whole
    global batch; its losses and final parameters."""
    opt = optimizer()

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch["x"], batch["y"], lambda h, spec: h)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = initial_params()
    opt_state = opt.init(params)
    losses = []
    for batch in batches():
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss))
    return losses, params


def pipeline_batches(context: jaxstrategy.InputContext) -> list[dict[str, np.ndarray]]:
    """`distribute_datasets_from_function`'s input: this pipeline's rows of each global batch."""
    rows = BATCH // context.num_input_pipelines
    start = context.input_pipeline_id * rows
    return [{k: v[start : start + rows] for k, v in batch.items()} for batch in batches()]


def train(strategy: jaxstrategy.Strategy, *, from_function: bool = False) -> dict[str, Any]:
    """Train through `strategy` and report the losses, the parameters and each leaf's layout;
    the batches from `distribute_datasets_from_function` when `from_function`."""
    opt = optimizer()

    def step(params, opt_state, batch):
        context = jaxstrategy.get_replica_context()
        loss, grads = jax.value_and_grad(loss_fn)(
            params, batch["x"], batch["y"], jaxstrategy.with_sharding_constraint
        )
        grads = context.all_reduce("mean", grads)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, context.all_reduce("mean", loss)

    with strategy.scope():
        params = strategy.put(initial_params())
        opt_state = strategy.init(opt.init, params)
        losses = []
        if from_function:
            dataset = strategy.distribute_datasets_from_function(pipeline_batches)
        else:
            dataset = strategy.experimental_distribute_dataset(batches())
        for batch in dataset:
            params, opt_state, loss = strategy.run(step, args=(params, opt_state, batch))
            losses.append(float(loss))
    local = {shard.device for shard in params["w1"].addressable_shards}
    # This process's copy of each leaf: on its own devices where it holds all of it.
    first = strategy.experimental_local_results(params)[0]
    held_here = {k: v.is_fully_addressable for k, v in first.items()}
    return {
        "losses": losses,
        # Every leaf is whole on some device of the job; gathered onto the host whole.
        "params": {
            k: np.asarray(jax.experimental.multihost_utils.process_allgather(v, tiled=True)).tolist()
            for k, v in params.items()
        },
        "specs": {k: str(tuple(v.sharding.spec)) for k, v in params.items()},
        "momentum_specs": {k: str(tuple(v.sharding.spec)) for k, v in _momentum(opt_state).items()},
        "w1_shard_shapes": [
            list(shape) for shape in sorted({s.data.shape for s in params["w1"].addressable_shards})
        ],
        "w1_bytes_here": sum(s.data.nbytes for s in params["w1"].addressable_shards),
        "local_devices": len(local),
        "held_here": held_here,
        "local_w1": np.asarray(first["w1"]).tolist() if held_here["w1"] else None,
    }


def _momentum(opt_state: Any) -> dict[str, jax.Array]:
    """SGD's momentum in `optimizer()`'s state, by parameter."""
    is_trace = lambda x: isinstance(x, optax.TraceState)  # noqa: E731
    (trace,) = [x for x in jax.tree.leaves(opt_state, is_leaf=is_trace) if is_trace(x)]
    return trace.trace


def layouts(strategy: jaxstrategy.MultiWorkerShardedStrategy) -> dict[str, Any]:
    return {
        "num_replicas": strategy.num_replicas_in_sync,
        "devices_per_replica": strategy.devices_per_replica,
        "mesh": dict(strategy.mesh.shape),
        "replica_devices": [[d.process_index for d in row.flat] for row in strategy.mesh.devices],
        "input_pipeline": list(strategy._job.input_pipeline),
    }


def uneven_ends(strategy: jaxstrategy.MultiWorkerShardedStrategy) -> dict[str, Any]:
    """Steps taken over pipelines that end at different steps (process 0's has one more batch),
    on one replica split over both processes: both must stop at the first end, with a warning."""
    count = 3 if jax.process_index() == 0 else 2
    dataset = strategy.distribute_datasets_from_function(
        lambda context: [np.ones((4, 2), np.float32)] * count
    )
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in dataset:
            total = strategy.run(
                lambda x: jaxstrategy.get_replica_context().all_reduce("sum", x.sum()), args=(batch,)
            )
            np.asarray(total.addressable_data(0))
            steps += 1
    return {"steps": steps, "warned": any("ended at step 2" in str(w.message) for w in caught)}


def diverging_values(strategy: jaxstrategy.Strategy) -> str:
    """Both processes hold the one replica: the values they compute for it must agree."""
    same = strategy.experimental_distribute_values_from_function(lambda context: np.arange(4.0))
    assert np.asarray(strategy.experimental_local_results(same)[0]).tolist() == [0.0, 1.0, 2.0, 3.0]
    try:
        strategy.experimental_distribute_values_from_function(
            lambda context: np.full(4, float(jax.process_index()), np.float32)
        )
    except ValueError as error:
        return str(error)
    return "no error"


def errors() -> dict[str, str]:
    found = {}
    for name, kwargs in {
        "three": {"num_replicas": 3},
        "model": {"num_replicas": 1, "model_parallel": 3},
    }.items():
        try:
            jaxstrategy.MultiWorkerShardedStrategy(**kwargs)
            found[name] = "no error"
        except ValueError as error:
            found[name] = str(error)
    return found


def main(output_dir: Path) -> None:
    # The default, in a job whose processes share one host: one replica over all 4 devices.
    strategy = jaxstrategy.MultiWorkerShardedStrategy(min_shard_bytes=0)
    report: dict[str, Any] = {"one_host": layouts(strategy)}
    report["diverging_values"] = diverging_values(strategy)
    report["one_host_training"] = train(strategy)
    # Both processes feed the one replica: they share its input pipeline, so read the same rows.
    report["one_host_from_function_training"] = train(strategy, from_function=True)
    report["one_host_uneven_ends"] = uneven_ends(strategy)
    # As if each process were on a host of its own: one replica per host, split within.
    real_hostname = socket.gethostname
    socket.gethostname = lambda: f"host-{jax.process_index()}"
    try:
        two_hosts = jaxstrategy.MultiWorkerShardedStrategy(min_shard_bytes=0)
    finally:
        socket.gethostname = real_hostname
    report["two_hosts"] = layouts(two_hosts)
    report["two_hosts_training"] = train(two_hosts)
    report["two_hosts_from_function_training"] = train(two_hosts, from_function=True)
    # Tensor parallelism: one replica over both processes, and a replica in each.
    for replicas in (1, 2):
        megatron = jaxstrategy.MultiWorkerShardedStrategy(
            num_replicas=replicas, model_parallel=2, layout=MEGATRON, min_shard_bytes=0
        )
        report[f"megatron_{replicas}"] = layouts(megatron)
        report[f"megatron_{replicas}_training"] = train(megatron)
    report["nnx"] = sharded_nnx_scenario.train(batches())
    report["errors"] = errors()
    (output_dir / f"process-{jax.process_index()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
