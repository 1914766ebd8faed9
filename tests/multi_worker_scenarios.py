"""What every process of a two-process job does for test_multi_worker.py; run by its launcher.

    python tests/multi_worker_scenarios.py OUTPUT_DIR

Each process runs the same scenarios in the same order, as any multi-worker program must, and
writes what it saw to OUTPUT_DIR/process-<index>.json for the test to check. A checkpoint goes to
OUTPUT_DIR/checkpoint, for the test to restore in one process.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import jaxstrategy
from jaxstrategy import checkpoint


def spec_example() -> tuple[jaxstrategy.MultiWorkerMirroredStrategy, dict[str, Any]]:
    """The spec page's cluster_resolver example, with the launcher's workers and a 'ps' job."""
    tf_config = json.loads(os.environ["TF_CONFIG"])
    tf_config["cluster"]["ps"] = ["127.0.0.1:1"]  # Listed, and not part of training.
    os.environ["TF_CONFIG"] = json.dumps(tf_config)
    # This implicitly uses TF_CONFIG for the cluster and current task info.
    strategy = jaxstrategy.MultiWorkerMirroredStrategy()
    if strategy.cluster_resolver.task_type == "worker":
        branch = "worker"
    elif strategy.cluster_resolver.task_type == "ps":
        branch = "ps"
    resolver = strategy.cluster_resolver
    return strategy, {
        "branch": branch,
        "task": [resolver.task_type, resolver.task_id, resolver.process_id, resolver.num_processes],
        "cluster_jobs": sorted(resolver.cluster_spec()),
        "num_replicas_in_sync": strategy.num_replicas_in_sync,
        "worker_devices": list(strategy.extended.worker_devices),
        "chief": [strategy.extended.should_checkpoint, strategy.extended.should_save_summary],
        "between_graph": strategy.extended.experimental_between_graph,
        "num_accelerators": resolver.num_accelerators(),
    }


def rejoining(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    """A second strategy joins the running job; a resolver for another place in it is an error."""
    resolver = strategy.cluster_resolver
    same = jaxstrategy.MultiWorkerMirroredStrategy(
        jaxstrategy.SimpleClusterResolver(resolver.coordinator_address, 2, resolver.process_id)
    )
    try:
        jaxstrategy.MultiWorkerMirroredStrategy(
            jaxstrategy.SimpleClusterResolver(resolver.coordinator_address, 2, 1 - resolver.process_id)
        )
        mismatch = "no error"
    except ValueError as error:
        mismatch = str(error)
    return {"second_strategy_equal": same == strategy, "mismatch": mismatch}


def collectives(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    ids = strategy.experimental_distribute_values_from_function(
        lambda context: np.full(1, context.replica_id_in_sync_group, np.float32)
    )
    run_ids = strategy.run(lambda: jaxstrategy.get_replica_context().replica_id_in_sync_group)
    total = strategy.run(lambda: jaxstrategy.get_replica_context().all_reduce("sum", 1))
    gathered = strategy.run(lambda x: jaxstrategy.get_replica_context().all_gather(x, axis=0), args=(ids,))
    return {
        "local_ids": [np.asarray(v).tolist() for v in strategy.experimental_local_results(ids)],
        "run_local_ids": [int(v) for v in strategy.experimental_local_results(run_ids)],
        "reduce_sum": np.asarray(strategy.reduce("sum", ids, axis=None)).tolist(),
        "reduce_mean": np.asarray(strategy.reduce("mean", ids, axis=None)).tolist(),
        "gather": np.asarray(strategy.gather(ids, axis=0)).tolist(),
        "all_reduce_in_run": int(total),
        "all_gather_in_run": np.asarray(gathered).tolist(),
        "put": np.asarray(strategy.put({"w": np.arange(3.0, dtype=np.float32)})["w"]).tolist(),
    }


def split_batches(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    """Every process reads the same global batches and keeps its replicas' parts."""
    batches = [np.arange(8 * i, 8 * i + 8, dtype=np.int32) for i in range(3)]
    dataset = strategy.experimental_distribute_dataset(batches)
    seen, sums = [], []
    for batch in dataset:
        seen.append([np.asarray(part).tolist() for part in strategy.experimental_local_results(batch)])
        sums.append(int(strategy.reduce("sum", batch, axis=0)))
    return {"local_parts": seen, "sums": sums, "len": len(dataset)}


def unequal_inputs(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    """Process 0's pipeline has 3 steps of data, process 1's has 5: both stop after 3."""

    def dataset_fn(context: jaxstrategy.InputContext) -> list[np.ndarray]:
        steps = 3 if context.input_pipeline_id == 0 else 5
        local = context.num_replicas_in_sync // context.num_input_pipelines
        return [np.full(2, context.input_pipeline_id, np.float32)] * (steps * local)

    def step(x: jax.Array) -> jax.Array:
        # A collective: a process that went on alone would wait here forever.
        return jaxstrategy.get_replica_context().all_reduce("sum", x)

    dataset = strategy.distribute_datasets_from_function(dataset_fn)
    steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in dataset:
            strategy.run(step, args=(batch,))
            steps += 1
    return {"steps": steps, "warnings": [str(w.message) for w in caught]}


def per_replica_inputs(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    """InputReplicationMode.PER_REPLICA: one pipeline per replica, each process its own."""
    contexts = []

    def dataset_fn(context: jaxstrategy.InputContext) -> list[np.ndarray]:
        contexts.append([context.num_input_pipelines, context.input_pipeline_id])
        return [np.full(2, context.input_pipeline_id, np.int32)] * 2

    options = jaxstrategy.InputOptions(experimental_replication_mode="PER_REPLICA")
    dataset = strategy.distribute_datasets_from_function(dataset_fn, options)
    parts = [[np.asarray(p).tolist() for p in strategy.experimental_local_results(b)] for b in dataset]
    return {"contexts": contexts, "parts": parts}


def python_numbers(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    value = strategy.experimental_distribute_values_from_function(lambda context: 0.5)
    (first, *_) = strategy.experimental_local_results(value)
    return {"dtype": str(first.dtype), "weak_type": bool(value.stacked.weak_type)}


def mismatched_datasets() -> dict[str, Any]:
    """Process 1 makes one dataset more than process 0, so the processes wait on different keys."""
    strategy = jaxstrategy.MultiWorkerMirroredStrategy(input_timeout_seconds=3)  # Joins the same job.
    if jax.process_index() == 1:
        strategy.experimental_distribute_dataset([np.zeros(4)])  # Never iterated.
    dataset = strategy.experimental_distribute_dataset([np.zeros(4)] * 2)
    try:
        list(dataset)
        return {"error": "no error"}
    except TimeoutError as error:
        return {"error": str(error)}


def shapes_that_differ_between_processes(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    """Each process's parts fit its own replicas but not the other process's: an error on both,
    never a global array of memory nobody wrote."""
    errors = {}
    try:
        value = strategy.experimental_distribute_values_from_function(
            lambda context: np.ones(jax.process_index() + 1, np.float32)
        )
        errors["values"] = f"no error: gathered {np.asarray(strategy.gather(value, axis=0)).tolist()}"
    except ValueError as error:
        errors["values"] = str(error)

    def dataset_fn(context: jaxstrategy.InputContext) -> list[np.ndarray]:
        # Per-replica batches for this process's two replicas: two steps, with process 1's last
        # batches short.
        last = 2 if context.input_pipeline_id == 0 else 1
        return [np.ones((2, 2), np.float32)] * 2 + [np.ones((last, 2), np.float32)] * 2

    gathered = []
    try:
        for batch in strategy.distribute_datasets_from_function(dataset_fn):
            gathered.append(np.asarray(strategy.gather(batch, axis=0)).tolist())
        errors["dataset"] = f"no error: gathered {gathered}"
    except ValueError as error:
        errors["dataset"] = str(error)
    return {"errors": errors, "steps_before": len(gathered)}


def under_jit(strategy: jaxstrategy.MultiWorkerMirroredStrategy) -> dict[str, Any]:
    """TF's tutorial wraps run and reduce in a tf.function; here they go inside one jax.jit."""
    value = strategy.experimental_distribute_values_from_function(
        lambda context: jnp.full((2,), context.replica_id_in_sync_group, jnp.float32)
    )

    @jax.jit
    def step_and_combine(x: Any) -> Any:
        out = strategy.run(lambda v: v * 2, args=(x,))
        return {
            "sum": strategy.reduce("sum", out, axis=None),
            "mean": strategy.reduce("mean", out, axis=0),
            "gathered": strategy.gather(out, axis=0),
        }

    combined = step_and_combine(value)
    try:
        jax.jit(lambda x: strategy.experimental_local_results(strategy.run(lambda v: v * 2, args=(x,))))(
            value
        )
        local_error = "no error"
    except ValueError as error:
        local_error = str(error)
    # docs/semantics.md: a jitted function may not close over an array split over the processes.
    try:
        closed_over = jax.jit(
            lambda: strategy.reduce("sum", strategy.run(lambda v: v * 2, args=(value,)), None)
        )
        closure_error = f"no error: {np.asarray(closed_over()).tolist()}"
    except RuntimeError as error:
        closure_error = str(error)
    replicated = strategy.put(np.ones(2, np.float32))
    return {
        "sum": np.asarray(combined["sum"]).tolist(),
        "mean": np.asarray(combined["mean"]).tolist(),
        "gathered": np.asarray(combined["gathered"]).tolist(),
        "local_results_error": local_error,
        "closure_error": closure_error,
        "closing_over_replicated": np.asarray(
            jax.jit(lambda: strategy.run(lambda: replicated * 2))()
        ).tolist(),
    }


def save_checkpoint(strategy: jaxstrategy.MultiWorkerMirroredStrategy, directory: Path) -> dict[str, Any]:
    """Both processes save one checkpoint: a replicated variable and a value sharded over them."""
    per_replica = strategy.experimental_distribute_values_from_function(
        lambda context: jnp.full((2,), context.replica_id_in_sync_group, jnp.float32)
    )
    tree = {
        "w": strategy.put(np.arange(6, dtype=np.float32).reshape(2, 3)),
        "per_replica": per_replica.stacked,
    }
    step = checkpoint.save(directory, tree)
    restored = checkpoint.restore(directory, strategy=strategy, target=tree)
    return {
        "step": step,
        "restored_here": np.asarray(restored["per_replica"]).tolist(),
    }


def main(output_dir: Path) -> None:
    strategy, results = spec_example()
    results["rejoining"] = rejoining(strategy)
    results["collectives"] = collectives(strategy)
    results["split_batches"] = split_batches(strategy)
    results["unequal_inputs"] = unequal_inputs(strategy)
    results["per_replica_inputs"] = per_replica_inputs(strategy)
    results["python_numbers"] = python_numbers(strategy)
    results["shapes_that_differ"] = shapes_that_differ_between_processes(strategy)
    results["under_jit"] = under_jit(strategy)
    results["mismatched_datasets"] = mismatched_datasets()  # Last: the processes' datasets differ.
    results["checkpoint"] = save_checkpoint(strategy, output_dir / "checkpoint")
    path = output_dir / f"process-{jax.process_index()}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
