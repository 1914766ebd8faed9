"""Where code runs: the current strategy and replica, and the contexts handed to user functions.

One `contextvars.ContextVar` holds the current strategy (set by `Strategy.scope()`) and, inside
`Strategy.run`, the replica context. A context variable, unlike a thread-local, follows asyncio
tasks; a new thread starts outside every scope, as in TensorFlow.

Because `run` traces its function once and then replays compiled code, the replica context
exists while the function is traced; that is exactly when user code asks for it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

import jax
import jax.numpy as jnp

from jaxstrategy._src.core.arguments import check_int
from jaxstrategy._src.core.errors import StrategyContextError, format_call
from jaxstrategy._src.core.tree_checks import require_array_leaves
from jaxstrategy._src.core.types import PyTree, StrategyLike
from jaxstrategy._src.values.reduce_op import ReduceOp, as_reduce_op, axes_of_leaves, mean_dtype

# A strategy class: `Strategy`, where users see it (`strategies/strategy.py`).
_S = TypeVar("_S", bound=StrategyLike)


@dataclasses.dataclass(frozen=True)
class _State:
    strategy: StrategyLike | None = None
    replica_context: ReplicaContext[Any] | None = None


OUTSIDE_EVERY_SCOPE = _State()
STATE: contextvars.ContextVar[_State] = contextvars.ContextVar(
    "jaxstrategy_state", default=OUTSIDE_EVERY_SCOPE
)


@contextlib.contextmanager
def entered(strategy: StrategyLike, replica_context: ReplicaContext[Any] | None = None) -> Iterator[None]:
    """Make `strategy` current (and `replica_context`, when given) for the duration."""
    token = STATE.set(_State(strategy, replica_context))
    try:
        yield
    finally:
        STATE.reset(token)


def require_cross_replica_context(strategy: StrategyLike, caller: str, *, in_run_hint: str) -> None:
    """Raise unless `strategy` may be used here: outside `run`, and not in another strategy's scope.

    Args:
      strategy: the strategy whose method is being called.
      caller: the call to name in the message, such as `MirroredStrategy.reduce()`.
      in_run_hint: what to do instead when called inside `run`.
    """
    state = STATE.get()
    if state.replica_context is not None:
        raise StrategyContextError(
            f"{caller} requires the cross-replica context, but it was called inside "
            f"Strategy.run (the replica context). {in_run_hint}"
        )
    if state.strategy is not None and state.strategy != strategy:
        raise StrategyContextError(
            f"Mixing different Strategy objects: {caller} was called on {strategy!r} inside the "
            f"scope of {state.strategy!r}. Leave that scope first, or use one strategy for both."
        )


def current_strategy() -> StrategyLike:
    """The strategy whose `scope()` is active, else the default one (`jaxstrategy.get_strategy`)."""
    strategy = STATE.get().strategy
    return _default_strategy() if strategy is None else strategy


# The state `experimental_set_strategy` installed in this context, which it may replace.
_SET_STATE: contextvars.ContextVar[_State | None] = contextvars.ContextVar(
    "jaxstrategy_set_state", default=None
)


def set_strategy(strategy: StrategyLike | None) -> None:
    """What `jaxstrategy.experimental_set_strategy` does (`strategies/strategy.py`)."""
    if strategy is not None and not isinstance(strategy, _registered().base):
        raise TypeError(
            f"jaxstrategy.experimental_set_strategy(): expected a jaxstrategy strategy or None; "
            f"got {strategy!r}."
        )
    state = STATE.get()
    if state is not OUTSIDE_EVERY_SCOPE and state is not _SET_STATE.get():
        where = "inside run" if state.replica_context is not None else "in its scope"
        raise RuntimeError(
            "jaxstrategy.experimental_set_strategy(): Must not be called inside a "
            f"`jaxstrategy.Strategy` scope ({state.strategy!r} is current, {where}). Leave the "
            "scope first."
        )
    new_state = OUTSIDE_EVERY_SCOPE if strategy is None else _State(strategy)
    STATE.set(new_state)
    _SET_STATE.set(None if strategy is None else new_state)


def has_strategy() -> bool:
    """Return whether a strategy's `scope()` (or `run`) is active.

    Example:
      >>> import jaxstrategy
      >>> with jaxstrategy.OneDeviceStrategy().scope():
      ...     jaxstrategy.has_strategy()
      True
      >>> jaxstrategy.has_strategy()
      False
    """
    return STATE.get().strategy is not None


def in_cross_replica_context() -> bool:
    """Return whether this code runs in a strategy's scope but outside `run`.

    False outside every scope, True inside `scope()`, False inside `run`, as in TensorFlow.

    Example:
      >>> import jaxstrategy
      >>> strategy = jaxstrategy.OneDeviceStrategy()
      >>> with strategy.scope():
      ...     jaxstrategy.in_cross_replica_context()
      True
      >>> def step(x):
      ...     print('in cross-replica context:', jaxstrategy.in_cross_replica_context())
      ...     return x
      >>> _ = strategy.run(step, args=(1,))
      in cross-replica context: False
    """
    state = STATE.get()
    return state.strategy is not None and state.replica_context is None


def current_replica_context() -> ReplicaContext[StrategyLike] | None:
    """What `jaxstrategy.get_replica_context` returns (`strategies/strategy.py`)."""
    state = STATE.get()
    if state.replica_context is not None:
        return state.replica_context
    if state.strategy is not None:
        return None
    return ReplicaContext(_default_strategy(), replica_id_in_sync_group=0)


@dataclasses.dataclass(frozen=True)
class _Strategies:
    base: type  # Abstract: `Strategy`.
    default: Callable[[], StrategyLike]


_strategies: _Strategies | None = None


def register_strategies(base: type, *, default: Callable[[], StrategyLike]) -> None:
    """Tell this module what a strategy is (`base`) and how to make the default one.

    The strategy modules import this one, so they register here (`strategies/one_device.py` does, on
    import, and the package imports it) rather than this module importing them.
    """
    global _strategies
    _strategies = _Strategies(base, default)
    _default_strategy.cache_clear()


def _registered() -> _Strategies:
    if _strategies is None:
        raise RuntimeError(
            "jaxstrategy's strategies are not registered: import jaxstrategy (which registers "
            "them), not jaxstrategy._src.values.contexts alone."
        )
    return _strategies


@functools.cache
def _default_strategy() -> StrategyLike:
    return _registered().default()


class ReplicaContext(Generic[_S]):
    """What a function running under `Strategy.run` knows about its replica, and its collectives.

    Get it with `jaxstrategy.get_replica_context()` inside the function. The collectives are
    JAX collectives over the strategy's replica axis; with one replica they return their input
    (converted to an array), with the dtype the many-replica result would have.

    Attributes:
      strategy: the strategy running the function.
      replica_id_in_sync_group: this replica's index; an int32 array inside `run` (a Python 0
        in the default context outside every scope).
      num_replicas_in_sync: the number of replicas, a Python int.
      devices: the strategy's devices (with one replica, the replica's own).

    Example:
      >>> import jaxstrategy
      >>> def step(x):
      ...     context = jaxstrategy.get_replica_context()
      ...     return context.all_reduce('mean', x)
      >>> jaxstrategy.OneDeviceStrategy().run(step, args=(3,)).tolist()
      3.0
    """

    def __init__(self, strategy: _S, replica_id_in_sync_group: Any, *, axis_name: str | None = None):
        self._strategy = strategy
        self._replica_id = replica_id_in_sync_group
        self._axis_name = axis_name

    @property
    def strategy(self) -> _S:
        return self._strategy

    @property
    def replica_id_in_sync_group(self) -> Any:
        return self._replica_id

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._strategy.devices

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={self._strategy!r}, replica_id_in_sync_group={self._replica_id!r})"

    def all_reduce(self, reduce_op: ReduceOp | str, value: PyTree, options: Any = None) -> PyTree:
        """Combine `value` (a pytree of arrays) across replicas; every replica gets the result.

        Args:
          reduce_op: `ReduceOp.SUM` or `ReduceOp.MEAN`, or its name in any case.
          value: a pytree of array-likes.
          options: accepted for TensorFlow compatibility; no effect.

        Returns:
          A pytree of arrays like `value`. MEAN of integers gives JAX's default float.

        Raises:
          ValueError, TypeError: a bad `reduce_op`; TypeError: a leaf that is not an array.
        """
        del options  # TensorFlow's CommunicationOptions tune its own runtime; XLA picks here.
        op = as_reduce_op(reduce_op, caller="ReplicaContext.all_reduce()")
        require_array_leaves(value, caller="ReplicaContext.all_reduce()")
        axis_name = self._axis_name

        def reduce(x: Any) -> jax.Array:
            x = jnp.asarray(x)
            if op is ReduceOp.MEAN:
                x = x.astype(mean_dtype(x.dtype))
                return x if axis_name is None else jax.lax.pmean(x, axis_name)
            return x if axis_name is None else jax.lax.psum(x, axis_name)

        return jax.tree.map(reduce, value)

    def all_gather(self, value: PyTree, axis: int, options: Any = None) -> PyTree:
        """Concatenate `value` from every replica along `axis`, in replica order.

        The result is the same on every replica, and `run` returns it as a replicated array.

        Args:
          value: a pytree of arrays of rank 1 or more.
          axis: the axis to concatenate along, in [-rank, rank).
          options: accepted for TensorFlow compatibility; no effect.

        Raises:
          ValueError: a leaf is a scalar or `axis` is out of its range (also with one replica,
            where TensorFlow returns the value unchanged, so code fails here as it would on many).
        """
        del options  # See all_reduce.
        axes = axes_of_leaves(value, axis, caller="ReplicaContext.all_gather()", single=True)
        leaves, treedef = jax.tree.flatten(value)
        gathered = []
        for leaf, (leaf_axis,) in zip(leaves, axes, strict=True):
            leaf = jnp.asarray(leaf)
            if self._axis_name is not None:
                # Its gradient is a sum of the replicas' upstream gradients, as in TensorFlow.
                leaf = jax.lax.all_gather(leaf, self._axis_name, axis=leaf_axis, tiled=True)
            gathered.append(leaf)
        return jax.tree.unflatten(treedef, gathered)

    def merge_call(
        self, merge_fn: Callable[..., Any], args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        """Not supported: raises NotImplementedError, on every strategy.

        TensorFlow stops every replica's thread here, runs `merge_fn(strategy, *args)` once in
        the cross-replica context, and resumes the replicas with its result. Here the replicas
        run as one SPMD program, which cannot stop to run Python across them. `OneDeviceStrategy`
        could run it, but refuses as well, so that code tested on one device works on many.
        `all_reduce` and `all_gather` cover what `merge_fn` usually does (combine values across
        replicas); anything else belongs outside `run`, on the values `run` returns.

        Raises:
          TypeError: `merge_fn` is not callable.
          NotImplementedError: always, otherwise; the message says what to use instead.

        Example:
          >>> import jaxstrategy
          >>> def step(x):
          ...     total = lambda strategy, v: strategy.reduce('sum', v, axis=None)
          ...     return jaxstrategy.get_replica_context().merge_call(total, args=(x,))
          >>> jaxstrategy.OneDeviceStrategy().run(step, args=(4,))
          Traceback (most recent call last):
          ...
          NotImplementedError: ReplicaContext.merge_call() is not supported: ...
        """
        if not callable(merge_fn):
            raise TypeError(f"ReplicaContext.merge_call(): merge_fn must be callable; got {merge_fn!r}.")
        raise NotImplementedError(
            "ReplicaContext.merge_call() is not supported: the replicas run as one SPMD program, "
            "which cannot stop to run Python code across them (OneDeviceStrategy refuses too, so "
            "that code tested on one device works on many). Combine values with all_reduce() or "
            "all_gather() inside run, or return them from run and call strategy.reduce() or "
            "strategy.gather() outside."
        )


@dataclasses.dataclass(frozen=True, slots=True)
class ValueContext:
    """The replica a `value_fn` of `experimental_distribute_values_from_function` is called for.

    Attributes:
      replica_id_in_sync_group: the replica's index, a Python int.
      num_replicas_in_sync: the number of replicas, a Python int.

    Example:
      >>> import jaxstrategy
      >>> jaxstrategy.ValueContext()
      ValueContext(replica_id_in_sync_group=0, num_replicas_in_sync=1)
    """

    replica_id_in_sync_group: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        _check_count("ValueContext()", "num_replicas_in_sync", self.num_replicas_in_sync)
        _check_index(
            "ValueContext()",
            "replica_id_in_sync_group",
            self.replica_id_in_sync_group,
            self.num_replicas_in_sync,
        )


@dataclasses.dataclass(frozen=True, slots=True)
class InputContext:
    """Which input pipeline a `dataset_fn` builds, and how many replicas it feeds.

    Attributes:
      num_input_pipelines: the number of input pipelines (one per worker process).
      input_pipeline_id: this pipeline's index, in [0, num_input_pipelines).
      num_replicas_in_sync: the number of replicas all pipelines feed together.

    Example:
      >>> import jaxstrategy
      >>> context = jaxstrategy.InputContext(num_replicas_in_sync=2)
      >>> context.get_per_replica_batch_size(64)
      32
      >>> print(context)
      jaxstrategy.InputContext(input pipeline id 0, total: 1)
    """

    num_input_pipelines: int = 1
    input_pipeline_id: int = 0
    num_replicas_in_sync: int = 1

    def __post_init__(self) -> None:
        _check_count("InputContext()", "num_input_pipelines", self.num_input_pipelines)
        _check_index("InputContext()", "input_pipeline_id", self.input_pipeline_id, self.num_input_pipelines)
        _check_count("InputContext()", "num_replicas_in_sync", self.num_replicas_in_sync)

    def __str__(self) -> str:  # TensorFlow's text, with this library's name.
        pipeline, total = self.input_pipeline_id, self.num_input_pipelines
        return f"jaxstrategy.InputContext(input pipeline id {pipeline}, total: {total})"

    def get_per_replica_batch_size(self, global_batch_size: int) -> int:
        """Return `global_batch_size // num_replicas_in_sync`.

        Raises:
          TypeError: `global_batch_size` is not an int (TensorFlow passes floats through).
          ValueError: `global_batch_size` is not divisible by `num_replicas_in_sync`.
        """
        check_int(
            global_batch_size,
            f"InputContext.get_per_replica_batch_size({global_batch_size!r})",
            not_int=TypeError,
        )
        if global_batch_size % self.num_replicas_in_sync:
            raise ValueError(
                f"The `global_batch_size` {global_batch_size} is not divisible by "
                f"`num_replicas_in_sync` {self.num_replicas_in_sync}; use a multiple of "
                f"{self.num_replicas_in_sync}."
            )
        return global_batch_size // self.num_replicas_in_sync


def _check_count(caller: str, field: str, value: Any) -> None:
    check_int(value, format_call(caller, f"{field}={value!r}"), at_least=1)


def _check_index(caller: str, field: str, value: Any, count: int) -> None:
    check_int(value, format_call(caller, f"{field}={value!r}"), at_least=0, below=count)


class StrategyScope(Generic[_S]):
    """What `Strategy.scope()` returns: a context manager that may be entered again, and nested,
    as TensorFlow's is (`scope = strategy.scope()`, then `with scope:` more than once)."""

    def __init__(self, strategy: _S):
        self._strategy = strategy
        self._entered: list[contextlib.ExitStack] = []

    def __enter__(self) -> _S:
        require_cross_replica_context(
            self._strategy,
            # The message reads "scope() was called on <the strategy's repr>", which names it.
            "scope()",
            in_run_hint="Enter the scope outside the function given to run().",
        )
        with contextlib.ExitStack() as stack:
            stack.enter_context(entered(self._strategy))
            stack.enter_context(self._strategy._default_device_scope())
            self._entered.append(stack.pop_all())
        return self._strategy

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self._entered.pop().__exit__(*exc_info)
