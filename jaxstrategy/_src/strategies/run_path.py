"""`Strategy.run`, whole: from the user's call to the compiled step, in one place.

`run` is called once per training step, forever, so what it adds to a bare `jax.jit` call is paid
by every user. A call takes one of two paths:

- **The hot path** (`RunPath.run`), taken by nearly every step of a loop: a function that
  `StepCache` compiled at an earlier call for positional arrays, called again with a tuple of
  them. The call goes straight to the function's fast entry (`StepCache.fast_entries`) once
  `fast_entry_takes` has checked what the entry cannot check itself. jit's C++ dispatch does the
  rest.
- **The checked path** (`RunPath.check_and_run`), for every other call: the arguments' types, the
  context, 64-bit host values, NNX objects (found once and unpacked to their state), then
  `StepCache`, which compiles what it must and publishes fast entries for later calls.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any, Protocol

import jax

from jaxstrategy._src.core.tree_checks import NARROW_LEAF_TYPES, has_wide_host_leaf, require_representable
from jaxstrategy._src.core.types import PyTree, StepFn, StrategyLike
from jaxstrategy._src.input.datasets import DistributedDataset, DistributedIterator
from jaxstrategy._src.steps import nnx_objects
from jaxstrategy._src.steps.argument_roles import has_static_leaves
from jaxstrategy._src.steps.cache import NeedsSlowPath, StepCache, fast_key
from jaxstrategy._src.values import contexts
from jaxstrategy._src.values.options import RunOptions

_MethodType = types.MethodType
_current_state = contexts.STATE.get
_OUTSIDE_EVERY_SCOPE = contexts.OUTSIDE_EVERY_SCOPE
_NARROW_LEAF_TYPES = NARROW_LEAF_TYPES
_narrow_types_include_all = NARROW_LEAF_TYPES.issuperset


def fast_entry_takes(strategy: StrategyLike, args: tuple[Any, ...]) -> bool:
    """Whether `strategy`'s fast entry of a function may be called with `args` as they are.

    A fast entry is the jit of a step, compiled by an earlier call of the same function with
    positional arrays, its input shardings pinned (see `StepCache._publish_fast`). jit refuses
    by itself what it can see: an argument that is not an array, arrays laid out otherwise,
    an NNX object nested in the arguments (when it traces). What it cannot see is checked here,
    in C wherever it can be, since this runs on every step:

    - the context: outside every strategy's scope, or in this one's outside `run`;
    - no argument is itself an NNX object (it would go in as a pytree, and its updates be lost);
    - no leaf is a 64-bit numpy integer or float, nor a Python float beyond float32's range:
      jit narrows it to 32 bits without retracing (a numpy int64 of 2**40 becomes 0), so it goes
      to the checked path, which refuses a value that does not fit. Arguments that are JAX
      arrays and Python ints are known narrow by their types alone, without flattening anything.

    `RunPath.run` makes these checks inline (a call less on every step).
    """
    state = _current_state()
    if state is not _OUTSIDE_EVERY_SCOPE and (
        state.strategy is not strategy or state.replica_context is not None
    ):
        return False
    return _narrow_types_include_all(map(type, args)) or _nested_arguments_admit(args)


def _nested_arguments_admit(args: tuple[Any, ...]) -> bool:
    """The argument checks of `fast_entry_takes` for arguments that are not all arrays."""
    return not nnx_objects.any_object_among(args) and not has_wide_host_leaf(args)


class RunsSteps(Protocol):
    """What `Strategy.run` calls: a `RunPath`, or one that a job wraps around it."""

    def run(
        self,
        fn: StepFn,
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> PyTree: ...


class RunPath:
    """`Strategy.run` of one strategy: `path.run(fn, args, kwargs, options)`.

    Args:
      strategy: the strategy whose context `run` requires (its scope, or none, outside `run`).
      steps: the strategy's compiled steps.
      before_checked_path: what the checked path calls first (the job's check that no process
        has ended), with `caller`.
      caller: `run` as the user wrote it, such as `MirroredStrategy.run()`.
    """

    __slots__ = (
        "_before_checked_path",
        "_caller",
        "_fast_entries",
        "_layout_may_change",
        "_steps",
        "_strategy",
    )

    def __init__(
        self,
        strategy: StrategyLike,
        steps: StepCache,
        *,
        before_checked_path: Callable[[str], None],
        caller: str,
    ):
        self._strategy = strategy
        self._steps = steps
        self._fast_entries = steps.fast_entries
        # A fast entry's ValueError may mean "not this layout" (then take the checked path)
        # only where the layout depends on the arguments; elsewhere it is the step's own error.
        self._layout_may_change = steps.layout_depends_on_arguments
        self._before_checked_path = before_checked_path
        self._caller = caller

    def run(
        self,
        fn: StepFn,
        args: Any = (),
        kwargs: dict[str, Any] | None = None,
        options: RunOptions | None = None,
    ) -> PyTree:
        """`Strategy.run(fn, args, kwargs, options)`; see its docstring."""
        try:
            if kwargs is None and type(args) is tuple:
                if options is None:  # function_key(fn), inline.
                    key: Any = (id(fn.__self__), id(fn.__func__)) if type(fn) is _MethodType else id(fn)
                else:
                    key = fast_key(fn, options) if type(options) is RunOptions else None
                entry = self._fast_entries.get(key)
                # `fast_entry_takes(self._strategy, args)`, inline; a loop over the few arguments
                # costs less than a `map` over them.
                if entry is not None and (
                    (state := _current_state()) is _OUTSIDE_EVERY_SCOPE
                    or (state.strategy is self._strategy and state.replica_context is None)
                ):
                    for arg in args:
                        if type(arg) not in _NARROW_LEAF_TYPES:
                            takes = _nested_arguments_admit(args)
                            break
                    else:
                        takes = True
                    if takes:
                        try:
                            return entry(*args)
                        except (NeedsSlowPath, TypeError, ValueError) as error:
                            if not self._entry_refused(error, args):
                                raise
            return self.check_and_run(fn, args, kwargs, options)
        except _PYTHON_CONTROL_ON_A_TRACED_VALUE as error:
            error.add_note(_STATIC_ARGUMENTS_HINT.format(caller=self._caller))
            raise

    def check_and_run(
        self, fn: StepFn, args: Any, kwargs: dict[str, Any] | None, options: RunOptions | None
    ) -> PyTree:
        """`run` for any call: check it, unpack NNX objects, then compile or call the step."""
        caller = self._caller
        self._before_checked_path(caller)
        if not callable(fn):
            raise TypeError(f"{caller}: fn must be callable; got {fn!r}.")
        if type(args) is not tuple:
            if not isinstance(args, tuple | list):
                raise ValueError(
                    f"{caller}: positional args must be a list or tuple, got {type(args).__name__}. "
                    "Pass a single argument as args=(x,)."
                )
            args = tuple(args)
        if kwargs is None:
            kwargs = {}
        elif not isinstance(kwargs, dict):
            raise TypeError(f"{caller}: kwargs must be a dict; got {type(kwargs).__name__}.")
        if options is not None and not isinstance(options, RunOptions):
            raise TypeError(f"{caller}: options must be a jaxstrategy.RunOptions; got {options!r}.")
        if any(
            isinstance(arg, DistributedIterator | DistributedDataset) for arg in (*args, *kwargs.values())
        ):
            raise ValueError(
                f"{caller}: an argument is a distributed dataset or iterator; run takes its "
                "elements. Pass strategy.run(step_fn, args=(next(iterator),)), or loop "
                "`for batch in dataset:` and pass `batch`."
            )
        contexts.require_cross_replica_context(
            self._strategy, caller, in_run_hint="Call the inner function directly instead of through run()."
        )
        # Not into NNX objects: their Variables hold arrays `put` placed, and flattening a model
        # costs as much as the rest of run's checks.
        require_representable(args, caller=caller, name="args", is_leaf=nnx_objects.is_object)
        require_representable(kwargs, caller=caller, name="kwargs", is_leaf=nnx_objects.is_object)
        user_fn, user_args = fn, args
        fn, args = nnx_objects.callee_as_argument(fn, args)
        found = nnx_objects.find_objects((args, kwargs))
        if found is None:
            return self._steps(fn, args, kwargs, options)
        donated = frozenset[int]()
        if options is not None:
            if options.static_argnums or options.static_argnames:
                raise ValueError(
                    f"{caller}: RunOptions' static arguments cannot be combined with Flax NNX "
                    "objects among the arguments (their state is passed for them). Pass a flag "
                    "as a string or an enum member instead, which run treats as static without "
                    "options; or pass the objects' state (nnx.split) in their place."
                )
            donated = nnx_objects.donated_objects(found, user_args, kwargs, options, caller)
        return nnx_objects.run_with_objects(self._run_unpacked, fn, found, caller, donated, user_fn)

    def _run_unpacked(
        self, fn: StepFn, args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions | None
    ) -> PyTree:
        """Run the step `run_with_objects` made of a function and the objects' state: through
        its fast entry once there is one (the state is arrays `put` placed), else `StepCache`.
        The fast entry is tried as `run` tries it."""
        entry = None if kwargs else self._fast_entries.get(fast_key(fn, options))
        if entry is not None and fast_entry_takes(self._strategy, args):
            try:
                return entry(*args)
            except (NeedsSlowPath, TypeError, ValueError) as error:
                if not self._entry_refused(error, args):
                    raise
        return self._steps(fn, args, kwargs, options)

    def _entry_refused(self, error: Exception, args: tuple[Any, ...]) -> bool:
        """Whether `error`, raised by a fast entry called with `args`, means the entry refused
        the call (which then takes `StepCache`'s path) rather than the step failing: the program
        asked for the slow path (`NeedsSlowPath`), jit rejected an argument that is not an array
        before tracing (a `TypeError` with such leaves), or the layout changed (a `ValueError`
        where the layout depends on the arguments)."""
        if isinstance(error, NeedsSlowPath):
            return True
        if isinstance(error, TypeError):
            return has_static_leaves(args)
        return self._layout_may_change


# What Python control flow on an argument of `run` raises while `fn` is traced.
_PYTHON_CONTROL_ON_A_TRACED_VALUE = (
    jax.errors.TracerBoolConversionError,
    jax.errors.TracerIntegerConversionError,
    jax.errors.ConcretizationTypeError,
)
_STATIC_ARGUMENTS_HINT = (
    "{caller}: fn is compiled once for all values of its array arguments, and Python bools, "
    "ints and floats passed to run are traced as arrays are, so Python `if`, `bool()`, `int()` "
    "or `range()` cannot read them. For a flag that chooses what fn does (training=True, a "
    "mode), pass it as static: RunOptions(static_argnums=...) or static_argnames=..., or as a "
    "string or an enum member, which run treats as static. For a value that changes every "
    "step, use jax.lax.cond or jnp.where instead."
)
