"""Test set-up shared by tests/ and the doctests in jaxstrategy/.

Four CPU devices are forced before JAX starts, so multi-device behaviour is tested on any
laptop; strict dtype promotion makes an accidental float64 or int/float mix fail loudly.
"""

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # Unless a launcher chose (the workers of tests/test_multi_worker.py run this suite with 2).
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=4"]
    ).strip()

import jax  # noqa: E402  (must come after XLA_FLAGS is set)

jax.config.update("jax_numpy_dtype_promotion", "strict")
