"""Sort a step's argument leaves into compile-time constants, donated arrays and kept arrays.

`jax.jit` takes static and donated arguments at the top level only, while a step's arguments are
pytrees whose leaves mix arrays with strings, enums and configs. A call that cannot go through jit
as it is is flattened here instead, and `StaticSpec.rebuild` puts it back together inside the
trace. The checks of a whole call are made here too (docs/internals.md, "Running a step").
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax

from jaxstrategy._src.core.errors import bullet_list, format_argument_path
from jaxstrategy._src.core.tree_checks import PYTHON_SCALARS, is_array_like
from jaxstrategy._src.core.types import PyTree
from jaxstrategy._src.values.options import RunOptions
from jaxstrategy._src.values.variables import device_buffers

_STATIC, _KEPT, _DONATED = 0, 1, 2


def jit_options(options: RunOptions | None) -> tuple[tuple[Any, ...], ...]:
    """The RunOptions fields that change how a step compiles: donation and static arguments."""
    if options is None:
        return ()
    return (options.donate_argnums, options.donate_argnames, options.static_argnums, options.static_argnames)  # type: ignore[return-value]


def has_static_leaves(tree: PyTree) -> bool:
    """Whether any leaf of `tree` is not an array or number, and so cannot be traced."""
    return not all(is_array_like(leaf) for leaf in jax.tree.leaves(tree))


@dataclasses.dataclass(frozen=True)
class StaticSpec:
    """The hashable part of a call: the argument structure and its non-array leaves.

    Each static leaf is kept with its type: 1, 1.0 and True are equal but must not share a
    compilation.
    """

    treedef: Any
    kinds: tuple[int, ...]
    static: tuple[tuple[type, Any], ...]

    def rebuild(self, donated: list[Any], kept: list[Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The `(args, kwargs)` this spec was split from, with these donated and kept leaves."""
        static = (leaf for _, leaf in self.static)
        sources = {_STATIC: static, _KEPT: iter(kept), _DONATED: iter(donated)}
        return jax.tree.unflatten(self.treedef, [next(sources[kind]) for kind in self.kinds])


class SplitArguments(NamedTuple):
    """One call's arguments, split: `spec` goes to jit as a static argument, `donated` as a
    donated one, `kept` as a plain one; the shardings are those of the donated and kept leaves."""

    spec: StaticSpec
    donated: list[Any]
    kept: list[Any]
    donated_shardings: list[Any]
    kept_shardings: list[Any]


@dataclasses.dataclass(frozen=True)
class ArgumentRoles:
    """Which arguments of a step are compile-time constants and which are donated.

    Attributes:
      static_argnums, static_argnames: positions in `args` and names in `kwargs` whose leaves are
        constants (RunOptions normalises them to sorted tuples).
      donate_argnums, donate_argnames: positions and names whose array leaves are donated.
      scalars_are_static: treat Python numbers as constants too (for `init`, whose integer
        arguments are usually sizes).
      caller: the call to name in messages, such as `OneDeviceStrategy.run()`.
    """

    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnums: tuple[int, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    scalars_are_static: bool = False
    caller: str = "Strategy.run()"
    # Per argument structure whose leaves are all jax arrays, where each leaf goes: there, a leaf's
    # role follows from its path alone, which a step's every call shares (see `split`).
    _plans: dict[Any, _Plan] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_options(
        cls, options: RunOptions | None, *, scalars_are_static: bool, caller: str
    ) -> ArgumentRoles:
        options = options or RunOptions()
        return cls(
            static_argnums=cast(tuple[int, ...], options.static_argnums),
            static_argnames=cast(tuple[str, ...], options.static_argnames),
            donate_argnums=cast(tuple[int, ...], options.donate_argnums),
            donate_argnames=cast(tuple[str, ...], options.donate_argnames),
            scalars_are_static=scalars_are_static,
            caller=caller,
        )

    @property
    def donates(self) -> bool:
        return bool(self.donate_argnums or self.donate_argnames)

    def split(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], shardings_of: Callable[[int], list[Any]]
    ) -> SplitArguments:
        """Sort the leaves of `(args, kwargs)` into constants, donated and kept leaves.

        `shardings_of(n)` gives the shardings of the n leaves, in flattening order.

        Raises:
          TypeError: a constant is not hashable (each one is named by path).
          ValueError: the options name an argument this call does not pass, or a donated array
            is also passed elsewhere in the call.
        """
        self.check_named_arguments_exist(args, kwargs)
        leaves, treedef = jax.tree.flatten((args, kwargs))
        plan = self._plans.get(treedef)
        if plan is not None and all(isinstance(leaf, jax.Array) for leaf in leaves):
            split = plan.split(leaves, shardings_of(len(leaves)))
            if split is not None:
                return split
        split = self._split_by_path(args, kwargs, shardings_of)
        if not split.spec.static and len(self._plans) < _PLANS_KEPT:
            self._plans[treedef] = _Plan.of(split.spec)
        return split

    def _split_by_path(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], shardings_of: Callable[[int], list[Any]]
    ) -> SplitArguments:
        """`split`, leaf by leaf: every check, and the messages that name leaves by path."""
        path_leaves, treedef = jax.tree_util.tree_flatten_with_path((args, kwargs))
        leaf_shardings = shardings_of(len(path_leaves))
        kinds: list[int] = []
        static: list[Any] = []
        donated: list[Any] = []
        kept: list[Any] = []
        donated_shardings: list[Any] = []
        kept_shardings: list[Any] = []
        unhashable: list[str] = []
        donated_at: dict[int, Any] = {}  # id of each donated array -> its path
        for (path, leaf), sharding in zip(path_leaves, leaf_shardings, strict=True):
            if self._is_static(path, leaf):
                kinds.append(_STATIC)
                static.append(leaf)
                if not _is_hashable(leaf):
                    unhashable.append(f"{format_argument_path(path)} is a {type(leaf).__name__}")
            elif _names(path, self.donate_argnums, self.donate_argnames):
                kinds.append(_DONATED)
                donated.append(leaf)
                donated_shardings.append(sharding)
                if isinstance(leaf, jax.Array):  # Only arrays have buffers; Python numbers are shared.
                    if id(leaf) in donated_at:
                        raise self._donated_twice(donated_at[id(leaf)], path)
                    donated_at[id(leaf)] = path
            else:
                kinds.append(_KEPT)
                kept.append(leaf)
                kept_shardings.append(sharding)
        if unhashable:
            raise TypeError(
                f"{self.caller}: compile-time constants (arguments that are not arrays, and those "
                "named by RunOptions.static_argnums / static_argnames) must be hashable, but these "
                f"are not:{bullet_list(unhashable)}\nPass them as arrays, make them hashable (a "
                "tuple instead of a list, a frozen dataclass), or close over them in the function."
            )
        if donated_at:  # A donated array must not also be passed where it is not donated.
            for path, leaf in path_leaves:
                if isinstance(leaf, jax.Array) and id(leaf) in donated_at:
                    if not _names(path, self.donate_argnums, self.donate_argnames):
                        raise self._donated_twice(donated_at[id(leaf)], path)
            arrays = [(path, leaf) for path, leaf in path_leaves if isinstance(leaf, jax.Array)]
            shared = _sharing_a_donated_buffer([leaf for _, leaf in arrays], set(map(id, donated)))
            if shared is not None:
                (donated_path, _), (also_path, _) = arrays[shared[0]], arrays[shared[1]]
                raise self._donated_twice(donated_path, also_path, same_buffer=True)
        typed_static = tuple((type(leaf), leaf) for leaf in static)
        spec = StaticSpec(treedef, tuple(kinds), typed_static)
        return SplitArguments(spec, donated, kept, donated_shardings, kept_shardings)

    def _is_static(self, path: tuple[Any, ...], leaf: Any) -> bool:
        return (
            not is_array_like(leaf)
            or (self.scalars_are_static and isinstance(leaf, PYTHON_SCALARS))
            or _names(path, self.static_argnums, self.static_argnames)
        )

    def check_named_arguments_exist(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Raise unless every argument RunOptions donates or makes static is passed: a position
        past the end, or a name given positionally, would silently donate or fix nothing."""
        missing = []
        for option, numbers, names in (
            ("donate", self.donate_argnums, self.donate_argnames),
            ("static", self.static_argnums, self.static_argnames),
        ):
            missing += [f"{option}_argnums position {n}" for n in numbers if n >= len(args)]
            missing += [f"{option}_argnames name {n!r}" for n in names if n not in kwargs]
        if missing:
            raise ValueError(
                f"{self.caller}: RunOptions names arguments that this call does not pass "
                f"({', '.join(missing)}); it passed {len(args)} positional argument(s) and "
                f"keyword arguments {sorted(kwargs)}. Positions count `args`; names match `kwargs` "
                "only, so pass a named argument as a keyword."
            )

    def _donated_twice(self, donated_path: Any, also_path: Any, *, same_buffer: bool = False) -> ValueError:
        # Paths are formatted only here: the slow path sorts every leaf on every call.
        donated_at, also_at = format_argument_path(donated_path), format_argument_path(also_path)
        what = (
            f"the arrays passed as {donated_at} and as {also_at} share a device buffer (two "
            "jax.device_put calls of one array can make such arrays; Strategy.put never does)"
            if same_buffer
            else f"the same array is passed as {donated_at} and as {also_at}"
        )
        return ValueError(
            f"{self.caller}: {what}, and {donated_at} is donated (RunOptions.donate_argnums / "
            "donate_argnames). Donation deletes the array's buffer, so it cannot also be used "
            "elsewhere in the call. Pass a copy (jnp.copy(x)) in one of the places, or do not "
            "donate it."
        )


# Argument structures planned per step: a step is called with a few, and the rest split by path.
_PLANS_KEPT = 8


@dataclasses.dataclass(frozen=True)
class _Plan:
    """Where each leaf of one argument structure goes, for calls whose leaves are all jax arrays
    (none of them static, since arrays cannot be hashed): what `split` works out leaf by leaf,
    kept, so that a donating step's every call is a flatten and two gathers."""

    spec: StaticSpec
    donated: tuple[int, ...]
    kept: tuple[int, ...]

    @classmethod
    def of(cls, spec: StaticSpec) -> _Plan:
        donated = tuple(i for i, kind in enumerate(spec.kinds) if kind == _DONATED)
        kept = tuple(i for i, kind in enumerate(spec.kinds) if kind == _KEPT)
        return cls(spec, donated, kept)

    def split(self, leaves: list[Any], shardings: list[Any]) -> SplitArguments | None:
        """The split of a call with these leaves, or None when a donated array is also passed
        elsewhere in it (splitting by path says where)."""
        donated = [leaves[i] for i in self.donated]
        kept = [leaves[i] for i in self.kept]
        donated_ids = set(map(id, donated))
        if len(donated_ids) < len(donated) or not donated_ids.isdisjoint(map(id, kept)):
            return None
        if donated and _sharing_a_donated_buffer(leaves, donated_ids) is not None:
            return None
        donated_shardings = [shardings[i] for i in self.donated]
        return SplitArguments(self.spec, donated, kept, donated_shardings, [shardings[i] for i in self.kept])


def _sharing_a_donated_buffer(arrays: list[Any], donated_ids: set[int]) -> tuple[int, int] | None:
    """The positions of a donated array and of another array of `arrays` over one of its device
    buffers, or None. Arrays that are the same object are not compared (the identity checks come
    first, and say so). Each array's buffers are read once (their cost: docs/performance.md,
    "`run` against a bare `jax.jit`")."""
    buffers = [device_buffers(array) for array in arrays]
    owner: dict[tuple[int, int], int] = {}
    for position, array in enumerate(arrays):
        if id(array) in donated_ids:
            for buffer in buffers[position]:
                owner.setdefault(buffer, position)
    if not owner:
        return None
    for position, array in enumerate(arrays):
        for buffer in buffers[position]:
            donated = owner.get(buffer)
            if donated is not None and arrays[donated] is not array:
                return donated, position
    return None


def _names(path: tuple[Any, ...], argnums: tuple[int, ...], argnames: tuple[str, ...]) -> bool:
    """Whether the leaf at `path` in `(args, kwargs)` lies under one of these positions or names."""
    group, top = path[0], path[1]
    return top.idx in argnums if group.idx == 0 else top.key in argnames


def _is_hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True
