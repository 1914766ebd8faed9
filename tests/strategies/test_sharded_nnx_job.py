"""`MultiWorkerShardedStrategy` with Flax NNX, in a real job of two processes of two CPU devices each.

A Flax NNX model whose kernels are annotated with logical axis names (`nnx.with_partitioning`),
mapped onto the replica's axes by `nnx.logical_axis_rules`, trains in place through `run` (its
`nnx.Optimizer` updated inside the step) with one replica over both processes, split over
'shard' and 'model': each process holds half of each kernel, laid out as annotated, and the
losses and parameters are those of the same model trained on one device.
"""

from __future__ import annotations

import json
from pathlib import Path

import chex
import numpy as np
import pytest
from sharded_nnx_worker import LAYOUTS, reference

from jaxstrategy._src.cluster.local_workers import describe_results
from jaxstrategy.testing import run_local_workers

NNX_WORKER = Path(__file__).resolve().parent / "sharded_nnx_worker.py"
TIMEOUT_S = 240


@pytest.mark.slow  # A job of two processes.
def test_an_nnx_model_annotated_with_logical_names_trains_in_place_over_two_processes(tmp_path):
    results = run_local_workers(
        [str(NNX_WORKER), str(tmp_path)], num_workers=2, devices_per_worker=2, timeout=TIMEOUT_S
    )
    assert [r.returncode for r in results] == [0, 0], describe_results(results)
    reports = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
    expected = reference()
    for num_replicas, model_parallel in LAYOUTS:
        name = f"{num_replicas}x{model_parallel}"
        for report in (r[name] for r in reports):
            # Each kernel, and its momentum, laid out as its annotation says: ('embed', 'mlp') is
            # ('shard', 'model'), and the reverse; each process holds half of each (the other
            # half is on the other process's devices).
            assert report["specs"] == {
                "up/kernel": ["('shard', 'model')"] * 2,
                "down/kernel": ["('model', 'shard')"] * 2,
            }, name
            assert report["held"] == {"up/kernel": [0.5, 0.5], "down/kernel": [0.5, 0.5]}, name
            # The same training as on one device: sums over split dimensions only add in
            # another order.
            np.testing.assert_allclose(report["losses"], expected["losses"], rtol=1e-5, err_msg=name)
            chex.assert_trees_all_close(report["params"], expected["params"], rtol=1e-5, atol=1e-6)
        assert reports[0][name]["params"] == reports[1][name]["params"], name
