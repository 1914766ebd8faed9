"""TensorFlow's loss-scaling helpers for training with several replicas (`tf.nn` in TF).

Each replica divides its examples' summed losses by the *global* batch size, and the replicas'
gradients are summed, so that training goes as one device would on the global batch. Numbers that
TensorFlow lets change silently (a wrapped batch size, a float16 overflow) do not here, and a
negative traced batch size gives nan rather than a check that would stall the host:
docs/internals.md, "Values", tells why.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.errors import StrategyContextError
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.tree_checks import require_representable
from jaxstrategy._src.values import contexts


def compute_average_loss(
    per_example_loss: Any, *, sample_weight: Any = None, global_batch_size: Any = None
) -> jax.Array:
    """The sum of this replica's per-example losses, weighted, divided by the global batch size.

    Use it inside `run` with `all_reduce('sum', grads)`: the summed gradients are then those of
    the mean loss over the global batch, on any number of replicas. When `global_batch_size` is
    None it is this replica's batch (the first dimension of `per_example_loss`) times
    `num_replicas_in_sync`; pass it when batches can be uneven (a padded last batch), so that
    every step divides by the number of real examples. A `global_batch_size` of 0 gives 0; a
    negative one computed inside `run` (a traced value, which cannot be refused there) gives nan,
    and nan gradients. Losses narrower than float32 (float16, bfloat16) are summed and divided
    in float32, and the result cast back, so a global batch past float16's 65504 still counts.

    The optional arguments are keyword-only: TensorFlow's order is `(per_example_loss,
    sample_weight, global_batch_size)`, and a positional call that meant the batch size would
    silently weight the examples instead.

    Args:
      per_example_loss: the losses of this replica's examples, of rank 1 or more (the first
        dimension is the batch).
      sample_weight: None, or weights for the examples: a scalar, one weight per example (such
        as the mask of a padded batch, also for losses of rank 2 and more, as in TensorFlow), or
        an array broadcastable to `per_example_loss`.
      global_batch_size: None, or the number of examples in the global batch: a non-negative
        integer (a Python int, or an integer array of rank 0) that JAX's integer type holds
        (int32 while `jax_enable_x64` is off).

    Returns:
      A scalar of `per_example_loss`'s dtype.

    Raises:
      ValueError: `per_example_loss` is a scalar; `global_batch_size` is negative or not a scalar.
      TypeError: `per_example_loss` is not floating point; `global_batch_size` is not an integer.
      OverflowError: `global_batch_size` is outside int32's range (uint32's, for an unsigned
        numpy integer) while `jax_enable_x64` is off: JAX would wrap it.
      StrategyContextError: (a `RuntimeError`) `global_batch_size` is None in a strategy's scope
        but outside `run`, where there is no replica batch to scale.

    Example:
      >>> import jax, jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
      >>> losses = strategy.experimental_distribute_values_from_function(
      ...     lambda context: jnp.full(3, context.replica_id_in_sync_group + 1.0))
      >>> def step(per_example_loss):
      ...     loss = jaxstrategy.nn.compute_average_loss(per_example_loss)  # sum / (3 * 2)
      ...     return jaxstrategy.get_replica_context().all_reduce('sum', loss)
      >>> strategy.run(step, args=(losses,)).tolist()  # (3 * 1 + 3 * 2) / 6
      1.5
    """
    caller = "jaxstrategy.nn.compute_average_loss()"
    losses = jnp.asarray(per_example_loss)
    if losses.ndim == 0:
        raise ValueError(
            f"{caller}: per_example_loss must have rank 1 or more, one loss per example along the "
            "first axis; got a scalar. Pass the losses before averaging them (reduction none)."
        )
    if not jnp.issubdtype(losses.dtype, jnp.floating):
        raise TypeError(f"{caller}: per_example_loss must be floating point; got {losses.dtype}.")
    # Half-precision losses are summed and divided in float32, then cast back: float16's largest
    # value is 65504, so a global batch of 70000 was an infinite divisor and the loss 0 (as in
    # TensorFlow, which divides in the losses' dtype), and so was a sum of losses past it.
    dtype = losses.dtype
    losses = losses.astype(_accumulation_dtype(dtype))
    if sample_weight is not None:
        losses = _weighted(losses, jnp.asarray(sample_weight), caller)
    if global_batch_size is None:
        _require_replica_context(caller, "pass global_batch_size")
        global_batch_size = losses.shape[0] * _num_replicas_in_sync()
    else:
        _check_batch_size(global_batch_size, caller)
    total = jnp.sum(losses)
    divisor = jnp.asarray(global_batch_size).astype(losses.dtype)
    # As TensorFlow's div_no_nan: a global batch of 0 examples has loss 0, not nan.
    safe_divisor = jnp.where(divisor == 0, 1, divisor)
    if is_tracer(global_batch_size):
        # Negative, it would turn training around. TensorFlow asserts at run time; a compiled
        # program cannot raise (docs/internals.md, "Values"), so the loss and its gradients are nan.
        safe_divisor = jnp.where(divisor < 0, jnp.nan, safe_divisor)
    return jnp.where(divisor == 0, jnp.zeros_like(total), total / safe_divisor).astype(dtype)


def scale_regularization_loss(regularization_loss: Any) -> jax.Array:
    """The sum of `regularization_loss` divided by the number of replicas in sync.

    Every replica adds the same regularization term to its loss; after `all_reduce('sum')` of
    the gradients it counts once, as on one device.

    Args:
      regularization_loss: a loss, or an array of losses to be summed, such as an L2 penalty.

    Returns:
      A scalar.

    Raises:
      StrategyContextError: (a `RuntimeError`) called in a strategy's scope but outside `run`.

    Example:
      >>> import jax.numpy as jnp, jaxstrategy
      >>> strategy = jaxstrategy.MirroredStrategy(['/cpu:0', '/cpu:1'])
      >>> scaled = lambda: jaxstrategy.nn.scale_regularization_loss(jnp.array([1.0, 3.0]))
      >>> strategy.run(scaled).tolist()
      2.0
    """
    _require_replica_context("jaxstrategy.nn.scale_regularization_loss()", "call it inside Strategy.run")
    return jnp.sum(jnp.asarray(regularization_loss)) / _num_replicas_in_sync()


def _weighted(losses: jax.Array, weights: jax.Array, caller: str) -> jax.Array:
    """`losses * weights` as TensorFlow lines them up: weights of one rank less than the losses
    (one per example of per-token losses, say) get a trailing axis, and a trailing axis of 1 on
    weights of one rank more is dropped. `losses` are in at least float32 already, as TensorFlow
    multiplies them."""
    given = weights.shape
    if weights.ndim == losses.ndim - 1:
        weights = weights[..., None]
    elif weights.ndim == losses.ndim + 1 and weights.shape[-1] == 1:
        weights = weights[..., 0]
    if weights.ndim and (
        weights.ndim != losses.ndim
        or any(w not in (1, n) for w, n in zip(weights.shape, losses.shape, strict=True))
    ):
        raise ValueError(
            f"{caller}: sample_weight of shape {given} does not fit per_example_loss of shape "
            f"{losses.shape}; pass a scalar, one weight per example (shape {losses.shape[:1]}), or "
            "an array broadcastable to the losses."
        )
    return losses * weights.astype(losses.dtype)


def _accumulation_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """float32 for floats narrower than it (float16, bfloat16, the float8 types), else `dtype`.

    Not `jnp.promote_types`: with strict dtype promotion it refuses float16 with float32."""
    return dtype if dtype.itemsize >= 4 else np.dtype(np.float32)


def _require_replica_context(caller: str, otherwise: str) -> None:
    # Outside every scope there is one replica, as in TensorFlow's default replica context.
    if contexts.in_cross_replica_context():
        raise StrategyContextError(
            f"{caller} was called in the cross-replica context (in a strategy's scope, outside "
            f"Strategy.run), where there is no replica batch to scale. Call it inside the function "
            f"given to Strategy.run, or {otherwise}."
        )


def _num_replicas_in_sync() -> int:
    replica_context = contexts.current_replica_context()
    return 1 if replica_context is None else replica_context.num_replicas_in_sync


def _check_batch_size(global_batch_size: Any, caller: str) -> None:
    if not (
        is_int(global_batch_size)
        or jnp.issubdtype(getattr(global_batch_size, "dtype", np.dtype(object)), jnp.integer)
    ):
        raise TypeError(
            f"{caller}: global_batch_size must be an integer, the number of examples in the global "
            f"batch; got {global_batch_size!r}."
        )
    if np.ndim(global_batch_size) != 0:
        raise ValueError(
            f"{caller}: global_batch_size must be a scalar; got shape {np.shape(global_batch_size)}."
        )
    # np.int64(2**32 + 2) would become the int32 2 while jax_enable_x64 is off.
    require_representable(global_batch_size, caller=caller, name="global_batch_size")
    if not is_tracer(global_batch_size) and int(global_batch_size) < 0:
        raise ValueError(f"{caller}: global_batch_size must be non-negative; got {int(global_batch_size)}.")
