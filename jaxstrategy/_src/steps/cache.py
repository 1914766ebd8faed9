"""Compile each step function once per strategy, then call it with its inputs placed.

`StepCache` keeps, per step function, the jits of its wrappers (one per input layout), and
publishes in `fast_entries` those that `run`'s hot path may call directly with `*args`: steps
called with positional arrays. Other calls (keyword arguments, leaves that are not arrays,
donation on several devices) go through `__call__`, the slow path. docs/internals.md, "Running a
step", tells which call takes which path, and why.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import types
import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import Any

import jax

from jaxstrategy._src.core.errors import caller_stacklevel
from jaxstrategy._src.core.jax_compat import is_tracer
from jaxstrategy._src.core.types import PyTree, StepFn
from jaxstrategy._src.steps.argument_roles import ArgumentRoles, StaticSpec, has_static_leaves, jit_options
from jaxstrategy._src.steps.in_flight import InFlightLimit
from jaxstrategy._src.values.options import RunOptions
from jaxstrategy._src.values.variables import device_put_anywhere

# Compiled wrappers kept per strategy. Beyond this the oldest is dropped (a program that makes a
# new function every step would otherwise keep every one of them alive).
_MAX_ENTRIES = 256
# How many distinct function objects with the same code are compiled before warning.
_RECOMPILES_BEFORE_WARNING = 2


def function_key(fn: Callable[..., Any]) -> Hashable:
    """The identity of a step function, which keeps no reference to it.

    A bound method is made afresh at every `obj.method` access, so it is identified by its object
    and function; anything else by itself. The key stays unique while the function (or the
    method's object) lives: `StepCache` drops a function's entries when it is collected.
    """
    if type(fn) is types.MethodType:
        return (id(fn.__self__), id(fn.__func__))
    return id(fn)


def fast_key(fn: Callable[..., Any], options: RunOptions | None) -> Hashable:
    """The key of `fn`'s compiled steps for calls with `options`: its `function_key`, with the
    jit options chosen (donation, static arguments), if any, since each is compiled apart."""
    key = function_key(fn)
    if options is not None and any(chosen := jit_options(options)):
        return (key, chosen)
    return key


class StepCache:
    """Compiled step functions of one strategy, each traced once.

    Entries hold their functions (and bound methods' objects) weakly, so a model or closure that
    the program drops is freed, with its device arrays, and its entries go with it.

    Args:
      in_shardings: where inputs are placed: a sharding for every input, or a function that,
        given `(args, kwargs)`, returns a sharding or a tree of them shaped like `(args, kwargs)`.
      out_shardings: where outputs are committed; None leaves it to what `program` returns (a
        `shard_map` decides it for each leaf).
      program: wraps a step function into what is traced, such as the function run in the
        replica context, or a `shard_map` of it over the replicas.
      in_flight_limit: when set, every call goes through it (see `InFlightLimit`; only
        `MirroredStrategy` on several CPU devices needs one).
      caller: the call to name in messages, such as `OneDeviceStrategy.run()`.
      scalars_are_static: treat Python scalars as compile-time constants rather than tracing
        them (for `init`, whose integer arguments are usually sizes).
      layout_key: where `in_shardings` is a function whose answer depends on where arrays are
        (which a trace cannot see), what a call's layout must keep for a compiled step to take
        it, computed from `(args, kwargs)` alike for arrays and tracers.

    `__call__` takes every call, compiling what it must. Calls it compiled for positional
    arrays are published in `fast_entries`, which `run`'s hot path (strategies/run_path.py) calls
    directly.
    """

    def __init__(
        self,
        *,
        in_shardings: jax.sharding.Sharding | Callable[[PyTree], PyTree],
        out_shardings: jax.sharding.Sharding | None,
        program: Callable[[StepFn], StepFn],
        caller: str,
        in_flight_limit: InFlightLimit | None = None,
        scalars_are_static: bool = False,
        layout_key: Callable[[PyTree], Hashable] | None = None,
    ):
        self._layout_key = layout_key
        # `fast_key(fn, options)` -> the compiled wrapper of each function whose last call had
        # only array-like positional arguments and no options (or, on one device, donation
        # alone), to be called as `fast_entries[key](*args)`; see `_publish_fast`.
        self.fast_entries: dict[Hashable, Callable[..., Any]] = {}
        self._in_flight_limit = in_flight_limit
        self._dispatch = self._call if in_flight_limit is None else in_flight_limit.wrap(self._call)
        self._in_shardings = in_shardings
        self._out_shardings = out_shardings
        self._settle_arrays = not isinstance(in_shardings, jax.sharding.SingleDeviceSharding)
        # Set where the layout depends on the arguments.
        self._layout_of = None if isinstance(in_shardings, jax.sharding.Sharding) else in_shardings
        self._program = program
        self._caller = caller
        self._scalars_are_static = scalars_are_static
        self._entries: dict[Hashable, _CompiledStep] = {}
        self._compiles_per_code: dict[types.CodeType, int] = {}

    @property
    def layout_depends_on_arguments(self) -> bool:
        """Whether a fast entry may refuse a call's layout (with a `ValueError`, which then means
        "take `__call__`" rather than an error of the step's)."""
        return self._layout_of is not None

    def __call__(
        self, fn: StepFn, args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions | None = None
    ) -> PyTree:
        return self._dispatch(fn, args, kwargs, options)

    def _call(
        self, fn: StepFn, args: tuple[Any, ...], kwargs: dict[str, Any], options: RunOptions | None
    ) -> PyTree:
        key = fast_key(fn, options)
        entry = self._entries.get(key)
        if entry is None:
            configured = options is not None and any(jit_options(options))
            entry = self._add(key, fn, options, count_towards_warning=not configured)
        layout = self._layout((args, kwargs))
        if entry.slow_path:
            return self._call_slow_path(key, entry, layout, args, kwargs)
        if kwargs:
            compiled, new = entry.jitted("packed", layout.inputs, layout)
        else:
            compiled, new = entry.jitted("positional", layout.for_positional(), layout)
        # A step compiled before may be called here with arrays elsewhere (its fast call failed
        # on them): where the layout depends on where arrays are, they are settled every time.
        if (new or self._layout_key is not None) and self._settle_arrays:
            args, kwargs = layout.settle((args, kwargs))
        try:
            result = compiled(args, kwargs) if kwargs else compiled(*args)
        except TypeError:
            # jit rejects non-array arguments before tracing; a TypeError with only array leaves
            # came from the function itself.
            if not has_static_leaves((args, kwargs)):
                raise
            entry.slow_path = True
            return self._call_slow_path(key, entry, layout, args, kwargs)
        if not kwargs:  # Jit options never get here: they always take the slow path.
            self._publish_fast(key, compiled)
        return result

    def _call_slow_path(
        self,
        key: Hashable,
        entry: _CompiledStep,
        layout: _Layout,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> PyTree:
        """A call of a step whose leaves Python sorts: static ones, donated ones, jit options."""
        if self._settle_arrays:  # The slow path does per-leaf work on every call anyway.
            args, kwargs = layout.settle((args, kwargs))
        # Where arrays are settled (several devices), every call must be: it stays slow there.
        if entry.donates_only and not self._settle_arrays and not kwargs and not has_static_leaves(args):
            # Checked here; compiled with jit's own donation, which the hot path then calls.
            entry.check_donation(layout, args)
            compiled, _ = entry.jitted("donating", layout.for_positional(), layout)
            result = compiled(*args)
            self._publish_fast(key, _refusing_arrays_donated_twice(compiled, entry.donate_argnums))
            return result
        self.fast_entries.pop(key, None)  # A fast entry would fail on these arguments.
        return entry.call_partitioned(layout, args, kwargs)

    def _publish_fast(self, key: Hashable, compiled: Callable[..., PyTree]) -> None:
        """Make `compiled` the fast entry of `key`: what `run`'s hot path calls as
        `fast_entries[key](*args)` when the caller has checked what `compiled` cannot (see
        strategies/run_path.py). It holds the jit of the step with its input shardings pinned,
        which itself refuses what else could differ from the call that compiled it: an argument
        that is not an array (TypeError before tracing), arrays laid out otherwise (ValueError
        where `layout_depends_on_arguments`), NNX objects nested in the arguments
        (`NeedsSlowPath`, raised by the program while tracing), and, for a donating entry, an
        array passed both donated and elsewhere (`NeedsSlowPath`)."""
        limit = self._in_flight_limit
        self.fast_entries[key] = compiled if limit is None else limit.wrap(compiled)

    def _layout(self, args_and_kwargs: PyTree) -> _Layout:
        if self._layout_of is None:
            return _Layout(self._in_shardings, self._out_shardings, None)
        inputs = self._layout_of(args_and_kwargs)
        key = _flat(inputs) if self._layout_key is None else self._layout_key(args_and_kwargs)
        return _Layout(inputs, self._out_shardings, key)

    def _add(
        self, key: Hashable, fn: StepFn, options: RunOptions | None, *, count_towards_warning: bool
    ) -> _CompiledStep:
        if len(self._entries) >= _MAX_ENTRIES:
            self._evict(next(iter(self._entries)))
        if count_towards_warning:
            self._warn_on_repeated_code(fn)
        layout_key = self._layout_key
        if layout_key is None and self._layout_of is not None:
            layout_of = self._layout_of
            layout_key = lambda args_and_kwargs: _flat(layout_of(args_and_kwargs))  # noqa: E731
        entry = _CompiledStep(fn, self._program, self._caller, options, self._scalars_are_static, layout_key)
        # When the function (or the method's object) is collected, its entry goes too; the id in
        # the key cannot be reused before then.
        owner = fn.__self__ if type(fn) is types.MethodType else fn
        try:
            entry.finalizer = weakref.finalize(owner, self._evict, key)
        except TypeError:  # Not weakly referenceable: the entry keeps it alive instead.
            entry.strong_reference = fn
        self._entries[key] = entry
        return entry

    def _evict(self, key: Hashable) -> None:
        entry = self._entries.pop(key, None)
        self.fast_entries.pop(key, None)
        if entry is not None and entry.finalizer is not None:
            entry.finalizer.detach()

    def _warn_on_repeated_code(self, fn: StepFn) -> None:
        # Only new function objects are a mistake worth a warning: a lambda, closure or partial
        # made per call. Methods of several objects, or one function with several options, are
        # compiled separately on purpose.
        code = _code_of(fn)
        if code is None:
            return
        count = self._compiles_per_code.get(code, 0) + 1
        self._compiles_per_code[code] = count
        if count == _RECOMPILES_BEFORE_WARNING + 1:
            warnings.warn(
                f"{self._caller} has now compiled {count} different function objects made from the "
                f"same code ({code.co_name} at {code.co_filename}:{code.co_firstlineno}). Each new "
                "function object, such as a lambda or a functools.partial made inside a loop, is "
                "traced and compiled again, which takes milliseconds per call. Define the function "
                "once, outside the loop, and pass that same object to every call.",
                stacklevel=caller_stacklevel(),
            )


# How XLA refuses a call that donates a buffer and uses it again (JAX 0.10.2 and 0.11).
_DONATED_BUFFER_USED_AGAIN = "previously donated in the same call"


def _refusing_arrays_donated_twice(
    compiled: Callable[..., PyTree], donate_argnums: tuple[int, ...]
) -> Callable[..., PyTree]:
    """`compiled`, handing to the slow path (which names the places) a call that passes one array
    in two places, one of them donated: XLA was seen to hang on that on CPU devices rather than
    refuse it. The check is by identity, in C (flattening, then sets of the leaves' ids), and looks
    at leaves in Python only when two ids match, which Python numbers (small ints share one
    object) may do without being arrays. Two arrays over one buffer (two `jax.device_put`s of one
    array) pass it, and XLA refuses the call before running it (this entry is for one device
    only, where it refuses rather than crashes), leaving the arguments intact: that call goes to
    the slow path too, which compares buffers and says where. Comparing buffers here instead
    would cost more than the check saves (docs/performance.md, "`run` against a bare `jax.jit`")."""
    donated_positions = frozenset(donate_argnums)

    def call(*args: Any) -> PyTree:
        if not donate_argnums or donate_argnums[-1] >= len(args):
            raise NeedsSlowPath
        donated = jax.tree.leaves([args[i] for i in donate_argnums])
        kept = jax.tree.leaves([arg for i, arg in enumerate(args) if i not in donated_positions])
        donated_ids = set(map(id, donated))
        if (len(donated_ids) < len(donated) or not donated_ids.isdisjoint(map(id, kept))) and (
            _an_array_donated_twice(donated, kept)
        ):
            raise NeedsSlowPath
        try:
            return compiled(*args)
        except ValueError as error:  # What jaxlib raises for it (JaxRuntimeError elsewhere).
            if _DONATED_BUFFER_USED_AGAIN not in str(error):
                raise
            raise NeedsSlowPath from error

    return call


def _an_array_donated_twice(donated: list[Any], kept: list[Any]) -> bool:
    """Whether a JAX array among the `donated` leaves is donated twice or also among `kept`."""
    donated_arrays = [leaf for leaf in donated if isinstance(leaf, jax.Array)]
    donated_ids = set(map(id, donated_arrays))
    return len(donated_ids) < len(donated_arrays) or any(id(leaf) in donated_ids for leaf in kept)


class NeedsSlowPath(Exception):
    """Raised by a `program` while tracing a fast wrapper, for arguments that only `__call__` may
    take (such as objects inside the arguments that the caller unpacks there): `run`'s hot path
    then hands the call to `__call__`. The failed trace is not kept, so each such call traces again."""


class LayoutChanged(ValueError):
    """Raised while tracing a step compiled for another input layout; `run` then takes the slow
    path, which compiles one for this layout."""


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where one call's inputs go (a sharding, or a tree of them shaped like `(args, kwargs)`),
    where its outputs go (None: where the program puts them), and what a compiled step checks
    when it traces (None where the layout does not depend on the arguments)."""

    inputs: Any
    outputs: jax.sharding.Sharding | None
    key: Hashable

    def for_positional(self) -> Any:
        """`in_shardings` for a call with the positional arguments only."""
        return self.inputs if isinstance(self.inputs, jax.sharding.Sharding) else self.inputs[0]

    def for_leaves(self, count: int) -> list[Any]:
        """One sharding per leaf of `(args, kwargs)`."""
        if isinstance(self.inputs, jax.sharding.Sharding):
            return [self.inputs] * count
        return jax.tree.leaves(self.inputs)

    def settle(self, args_and_kwargs: PyTree) -> Any:
        """`args_and_kwargs` with each JAX array that is not where this layout puts it moved there."""
        leaves, treedef = jax.tree.flatten(args_and_kwargs)
        shardings = self.for_leaves(len(leaves))
        pairs = zip(leaves, shardings, strict=True)
        moving = [i for i, (leaf, where) in enumerate(pairs) if _misplaced(leaf, where)]
        if not moving:
            return args_and_kwargs
        moved = device_put_anywhere([leaves[i] for i in moving], [shardings[i] for i in moving])
        for i, leaf in zip(moving, moved, strict=True):
            leaves[i] = leaf
        return jax.tree.unflatten(treedef, leaves)

    def for_partitioned(self, donated: list[Any], kept: list[Any]) -> Any:
        """`in_shardings` for a call with the donated and the kept leaves, given their shardings."""
        return self.inputs if isinstance(self.inputs, jax.sharding.Sharding) else (donated, kept)


class _CompiledStep:
    """The jitted wrappers of one step function: a fast one, and one for static or donated leaves,
    each compiled per input layout."""

    def __init__(
        self,
        fn: StepFn,
        program: Callable[[StepFn], StepFn],
        caller: str,
        options: RunOptions | None,
        scalars_are_static: bool,
        layout_key: Callable[[PyTree], Hashable] | None,
    ):
        self.finalizer: weakref.finalize[Any, Any] | None = None
        self.strong_reference: Any = None
        self._roles = ArgumentRoles.from_options(
            options, scalars_are_static=scalars_are_static, caller=caller
        )
        # Jit options and static scalars need the argument leaves sorted in Python on every call,
        # but for donation alone, where jit's own donation takes positional arrays as they are.
        self.slow_path = any(jit_options(options)) or scalars_are_static
        roles = self._roles
        self.donate_argnums = tuple(sorted(roles.donate_argnums))
        self.donates_only = roles.donates and not (
            roles.static_argnums or roles.static_argnames or scalars_are_static
        )
        resolve = weak_resolver(fn)

        def call_positional(*args: Any) -> PyTree:
            return program(resolve())(*args)

        def call_packed(args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
            return program(resolve())(*args, **kwargs)

        def call_with_static(spec: StaticSpec, donated: list[Any], kept: list[Any]) -> PyTree:
            args, kwargs = spec.rebuild(donated, kept)
            return program(resolve())(*args, **kwargs)

        source = _source_info(fn)
        wrappers: tuple[Any, ...] = (call_positional, call_packed, call_with_static)
        for wrapper in wrappers:
            # JAX names the compiled program, and points its tracing errors, at the user's code.
            wrapper.__name__ = wrapper.__qualname__ = source.__name__
            wrapper.__wrapped__ = source
        self._wrappers = {
            "positional": call_positional,
            "donating": call_positional,
            "packed": call_packed,
            "partitioned": call_with_static,
        }
        self._layout_key = layout_key
        self._jitted: dict[Hashable, Callable[..., PyTree]] = {}

    def jitted(self, kind: str, in_shardings: Any, layout: _Layout) -> tuple[Callable[..., PyTree], bool]:
        """The jit of the `kind` wrapper ("positional", "donating", "packed" or "partitioned")
        with these input shardings, for calls with `layout`, and whether it was made just now."""
        key = (kind, _flat(in_shardings), layout.outputs)
        jitted = self._jitted.get(key)
        if jitted is not None:
            return jitted, False
        wrapper = self._wrappers[kind]
        pinned: dict[str, Any] = {"in_shardings": in_shardings}
        if layout.outputs is not None:
            pinned["out_shardings"] = layout.outputs
        if kind == "partitioned":
            pinned.update(static_argnums=0, donate_argnums=1 if self._roles.donates else ())
        else:
            if kind == "donating":
                pinned["donate_argnums"] = self._roles.donate_argnums
            if self._layout_key is not None:  # Fast-path jits check their layout when they trace.
                wrapper = _checking_layout(wrapper, self._layout_key, layout, packed=kind == "packed")
        jitted = self._jitted[key] = jax.jit(_announcing_inputs(wrapper, layout.inputs), **pinned)
        return jitted, True

    def check_donation(self, layout: _Layout, args: tuple[Any, ...]) -> None:
        """Raise what `ArgumentRoles.split` finds wrong with a donating call of these arguments: an
        option naming nothing, an array donated twice."""
        self._roles.split(args, {}, layout.for_leaves)

    def call_partitioned(self, layout: _Layout, args: tuple[Any, ...], kwargs: dict[str, Any]) -> PyTree:
        split = self._roles.split(args, kwargs, layout.for_leaves)
        in_shardings = layout.for_partitioned(split.donated_shardings, split.kept_shardings)
        jitted, _ = self.jitted("partitioned", in_shardings, layout)
        return jitted(split.spec, split.donated, split.kept)


def _misplaced(leaf: Any, where: jax.sharding.Sharding) -> bool:
    # A tracer (run inside an outer jit) has no placement of its own.
    return isinstance(leaf, jax.Array) and not is_tracer(leaf) and leaf.sharding != where


def _flat(tree: PyTree) -> Hashable:
    """A hashable form of a tree of shardings."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple(leaves))


def _checking_layout(
    wrapper: Callable[..., PyTree], layout_key: Callable[[PyTree], Hashable], layout: _Layout, *, packed: bool
) -> Callable[..., PyTree]:
    """`wrapper`, raising `LayoutChanged` when traced with arguments whose layout is not `layout`."""
    expected = layout.key

    def checked(*args: Any) -> PyTree:
        args_and_kwargs = (args[0], args[1]) if packed else (args, {})
        if layout_key(args_and_kwargs) != expected:
            raise LayoutChanged("The inputs' layout changed since this step was compiled.")
        return wrapper(*args)

    checked.__name__ = checked.__qualname__ = wrapper.__name__
    checked.__wrapped__ = wrapper.__wrapped__  # type: ignore[attr-defined]
    return checked


# The input layout of the step being traced: set while jit traces a step's wrapper.
_TRACED_INPUTS: contextvars.ContextVar[Any] = contextvars.ContextVar("traced_inputs", default=None)


def traced_input_layout() -> Any:
    """Where the inputs of the step being traced were placed: a sharding for every input, or a
    tree of them shaped like `(args, kwargs)`; None outside a trace of `StepCache`'s steps.

    A trace sees no placements (a tracer has none), so a program that lays its outputs out after
    its inputs (ShardedStrategy's) reads them here."""
    return _TRACED_INPUTS.get()


def _announcing_inputs(wrapper: Callable[..., PyTree], inputs: Any) -> Callable[..., PyTree]:
    """`wrapper`, making `inputs` the `traced_input_layout()` while it runs (when jit traces it)."""

    def announcing(*args: Any) -> PyTree:
        token = _TRACED_INPUTS.set(inputs)
        try:
            return wrapper(*args)
        finally:
            _TRACED_INPUTS.reset(token)

    announcing.__name__ = announcing.__qualname__ = wrapper.__name__
    announcing.__wrapped__ = getattr(wrapper, "__wrapped__", wrapper)  # type: ignore[attr-defined]
    return announcing


def weak_resolver(fn: StepFn) -> Callable[[], StepFn]:
    """A function returning `fn` without keeping it (or a bound method's object) alive."""
    try:
        if type(fn) is types.MethodType:
            function, owner = fn.__func__, weakref.ref(fn.__self__)
            return lambda: types.MethodType(function, owner())
        return weakref.ref(fn)  # type: ignore[return-value]
    except TypeError:  # Not weakly referenceable; StepCache keeps a strong reference instead.
        return lambda: fn


def _source_info(fn: StepFn) -> types.SimpleNamespace:
    """What JAX reads to name a compiled function and to point errors at its source.

    It holds the code object only (no closure, no object), so it keeps nothing alive.
    """
    name = getattr(fn, "__name__", None) or type(fn).__name__
    return types.SimpleNamespace(__name__=name, __qualname__=name, __code__=_code_of(fn))


def _code_of(fn: Any) -> types.CodeType | None:
    """The code a lambda, function or functools.partial runs; None for other callables."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    code = getattr(fn, "__code__", None) if isinstance(fn, types.FunctionType) else None
    return code if isinstance(code, types.CodeType) else None
