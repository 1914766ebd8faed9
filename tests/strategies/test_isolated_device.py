"""In a fresh process with two CPU devices, a strategy on cpu:1 leaves nothing on cpu:0."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    import jax, jax.numpy as jnp, numpy as np
    import jaxstrategy

    strategy = jaxstrategy.OneDeviceStrategy("/cpu:1")
    with strategy.scope():
        params = strategy.init(lambda key: {"w": jax.random.normal(key, (8, 4)), "b": jnp.zeros(4)}, jax.random.key(0))
        made_in_scope = jnp.ones(3)
    extra = strategy.put({"scale": 2.0, "host": np.ones(4, np.float32)})

    def step(params, x, scale):
        context = jaxstrategy.get_replica_context()
        loss = jnp.mean((x @ params["w"] + params["b"]) ** 2) * scale
        return jax.tree.map(lambda p: p * 0.99, params), context.all_reduce("mean", loss)

    result = 0
    for i in range(5):
        params, loss = strategy.run(step, args=(params, np.full((2, 8), i, np.float32), extra["scale"]))
        result += strategy.run(lambda x: x * 2, args=(i,))
    total = strategy.reduce("sum", jnp.arange(10), axis=0)
    values = strategy.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.num_replicas_in_sync))
    jax.block_until_ready((params, loss, result, total, values))

    cpu0, cpu1 = jax.devices()
    on_cpu0 = [a.shape for a in jax.live_arrays() if cpu0 in a.devices()]
    print("live arrays on cpu:0:", on_cpu0)
    print("live arrays on cpu:1:", sum(cpu1 in a.devices() for a in jax.live_arrays()))
    print("result", int(result))
    """
)


@pytest.mark.slow  # A fresh process.
def test_nothing_lands_on_cpu0():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "live arrays on cpu:0: []" in lines
    assert "result 20" in lines
    on_cpu1 = int(next(line for line in lines if line.startswith("live arrays on cpu:1:")).split(":")[-1])
    assert on_cpu1 >= 8
