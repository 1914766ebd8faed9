"""Where each leaf of a sharded strategy's trees lives: a `PartitionSpec` over its replica's axes.

`ShardedStrategy` splits every replica's model over the replica's devices, along `'shard'` (fully
sharded data parallelism) and `'model'` (tensor parallelism), never over `'replica'`. A leaf's
spec comes from its own declaration (NNX sharding metadata), else the user's rules, else the input
it follows, else the default of splitting its largest divisible dimension; docs/internals.md,
"Values", gives the rules in full.
"""

from __future__ import annotations

import dataclasses
import math
import re
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.sharding import PartitionSpec

from jaxstrategy._src.core.errors import bullet_list, caller_stacklevel

# The mesh axis over which each replica's leaves are split (fully sharded data parallelism).
SHARD_AXIS = "shard"
# The mesh axis over which the layers that rules name are split (tensor parallelism).
MODEL_AXIS = "model"
# The axes a spec may name, within a replica.
REPLICA_AXES = (SHARD_AXIS, MODEL_AXIS)
# TensorFlow's `MinSizePartitioner` default: below this a leaf is cheaper replicated than gathered.
DEFAULT_MIN_SHARD_BYTES = 256 * 1024

# How a rule's spec may be written: a PartitionSpec, or a tuple or list of its entries.
SpecLike = PartitionSpec | Sequence[str | None | Sequence[str]]


def path_string(path: Sequence[Any]) -> str:
    """A key path as the rules see it: its keys joined by `/`, as `0/dense/kernel`."""
    return "/".join(_key_name(key) for key in path)


def _key_name(key: Any) -> str:
    for attribute in ("key", "name", "idx"):
        if hasattr(key, attribute):
            return str(getattr(key, attribute))
    return str(key)


@dataclasses.dataclass(frozen=True)
class LeafLayout:
    """How one leaf is laid out, and why.

    Attributes:
      path: the leaf's path, keys joined by `/`.
      shape: its shape.
      dtype: its dtype.
      spec: its `PartitionSpec` within a replica (over `'shard'` and `'model'`).
      reason: what decided it, for `describe_layout`.
      bytes_per_device: what one device holds of it.
    """

    path: str
    shape: tuple[int, ...]
    dtype: Any
    spec: PartitionSpec
    reason: str
    bytes_per_device: int


@dataclasses.dataclass(frozen=True)
class _Rule:
    source: str
    pattern: re.Pattern[str]
    spec: PartitionSpec


class LayoutRules:
    """The rules of one sharded strategy: how many shards, from what size, and the user's rules.

    Args:
      layout: the user's `(regex, spec)` pairs, or None.
      shards: S, the size of the `'shard'` axis.
      model: M, the size of the `'model'` axis (1: none).
      min_shard_bytes: leaves smaller than this are replicated by the default rule.
      caller: the call to name in messages, such as `ShardedStrategy()`.

    Raises:
      TypeError: `layout` is not a sequence of `(regex, spec)` pairs.
      ValueError: a regex does not compile, a spec names an axis other than `'shard'` and
        `'model'` or names one twice, or `min_shard_bytes` is negative.
    """

    def __init__(self, layout: Any, *, shards: int, model: int = 1, min_shard_bytes: int, caller: str):
        if isinstance(min_shard_bytes, bool) or not isinstance(min_shard_bytes, int) or min_shard_bytes < 0:
            raise ValueError(
                f"{caller}: min_shard_bytes must be a non-negative int (bytes); got {min_shard_bytes!r}."
            )
        self.shards = shards
        self.model = model
        self.min_shard_bytes = min_shard_bytes
        self._caller = caller
        self._rules = tuple(_parse_rules(layout, caller))
        self._warned_rules: set[str] = set()
        self._warned_leaves: set[str] = set()

    @property
    def devices_per_replica(self) -> int:
        """S x M: the devices each replica's leaves are split over."""
        return self.shards * self.model

    def on_mesh(self, spec: PartitionSpec) -> PartitionSpec:
        """`spec` as the mesh can take it: without `'model'` when there is no such axis."""
        return spec if self.model > 1 else without_axis(spec, MODEL_AXIS)

    def axis_size(self, entry: Any) -> int:
        """How many devices a spec's entry (None, an axis, or a tuple of axes) splits over."""
        sizes = {SHARD_AXIS: self.shards, MODEL_AXIS: self.model}
        return math.prod(sizes[name] for name in _names(entry))

    @property
    def rules(self) -> tuple[tuple[str, PartitionSpec], ...]:
        """The user's rules, as given (regex source, spec)."""
        return tuple((rule.source, rule.spec) for rule in self._rules)

    def leaf(
        self,
        path: Sequence[Any],
        shape: tuple[int, ...],
        dtype: Any,
        *,
        declared: tuple[PartitionSpec, str] | None = None,
        follows: tuple[PartitionSpec, str] | None = None,
        caller: str | None = None,
    ) -> LeafLayout:
        """The layout of the leaf at `path` (a key path) of this shape and dtype.

        Args:
          declared: the spec the leaf declares itself, and what declared it (an NNX Variable's
            metadata).
          follows: the spec of the input it follows, and that input's path (outputs of `run`
            and `init`).
          caller: the call to name in messages (the strategy's constructor, if None).

        Raises:
          ValueError: two rules match the leaf; a spec has more entries than the leaf has
            dimensions, or splits a dimension that S does not divide.
        """
        name = path_string(path)
        dtype = _as_dtype(dtype)
        who = caller or self._caller
        chosen = declared
        if chosen is None and (rule := self._matching_rule(path, name, who)) is not None:
            chosen = rule.spec, f"rule {rule.source!r}"
        unused = None
        if chosen is not None:
            self._check_fits(*chosen, name, shape, who)
            if self._names_only_a_missing_model_axis(chosen[0]):
                # A tensor-parallel layout on a strategy without tensor parallelism: the leaf is
                # laid out as if nothing named it (split over 'shard'), not replicated.
                unused, chosen = chosen[1], None
        if chosen is not None:
            spec, reason = chosen
        elif follows is not None:
            spec, reason = follows[0], f"follows {follows[1]}"
        else:
            spec, reason = self._default(name, shape, dtype, who)
        if unused is not None:
            reason = f"{reason} ({unused} names only 'model', an axis of 1 here)"
        spec = self.on_mesh(spec)
        split = math.prod(self.axis_size(entry) for entry in spec)
        size = math.prod(shape) * dtype.itemsize
        return LeafLayout(name, tuple(shape), dtype, spec, reason, size // split)

    def unmatched_rules(self, paths: Sequence[Sequence[Any]]) -> list[str]:
        """The sources of the rules that decide none of these leaves' paths."""
        names = [path_string(path) for path in paths]
        suffixes = [s for path, name in zip(paths, names, strict=True) for s in _suffixes(path, name)]
        return [rule.source for rule in self._rules if not any(rule.pattern.fullmatch(s) for s in suffixes)]

    def warn_unmatched(self, paths: Sequence[Sequence[Any]], caller: str) -> None:
        """Warn, once per rule and strategy, about rules that decide none of a tree of variables."""
        unmatched = [source for source in self.unmatched_rules(paths) if source not in self._warned_rules]
        if not unmatched:
            return
        self._warned_rules.update(unmatched)
        warnings.warn(
            f"{caller}: the layout rule{'s' if len(unmatched) > 1 else ''} "
            f"{', '.join(repr(s) for s in unmatched)} matched no leaf of the tree. A rule's regex must "
            "match a leaf's whole path, or a trailing part of it made of whole keys (keys joined by "
            "'/', as 'dense/kernel'); strategy.describe_layout(tree) shows the paths.",
            stacklevel=caller_stacklevel(),
        )

    def _matching_rule(self, path: Sequence[Any], name: str, caller: str) -> _Rule | None:
        suffixes = _suffixes(path, name)
        matching = [rule for rule in self._rules if any(rule.pattern.fullmatch(s) for s in suffixes)]
        if len(matching) > 1:
            raise ValueError(
                f"{caller}: the leaf {name!r} matches more than one layout rule:"
                f"{bullet_list([repr(rule.source) for rule in matching])}\nEach leaf must match one rule at "
                "most; make the regexes more specific (they match the whole path, or trailing keys)."
            )
        return matching[0] if matching else None

    def _names_only_a_missing_model_axis(self, spec: PartitionSpec) -> bool:
        names = {n for entry in spec for n in _names(entry)}
        return self.model == 1 and names == {MODEL_AXIS}

    def _check_fits(
        self, spec: PartitionSpec, reason: str, name: str, shape: tuple[int, ...], caller: str
    ) -> None:
        if len(spec) > len(shape):
            raise ValueError(
                f"{caller}: the layout {spec} from {reason} has {len(spec)} entries, but the leaf "
                f"{name!r} has shape {tuple(shape)} ({len(shape)} dimensions). Give a spec with at "
                "most one entry per dimension."
            )
        for dimension, entry in enumerate(self.on_mesh(spec)):
            split = self.axis_size(entry)
            if shape[dimension] % split:
                raise ValueError(
                    f"{caller}: the layout {spec} from {reason} splits dimension {dimension} "
                    f"(of size {shape[dimension]}) of the leaf {name!r} over {split} devices, "
                    f"which does not divide it. Split a dimension that {split} divides, or "
                    "replicate the leaf (spec PartitionSpec())."
                )

    def _default(
        self, name: str, shape: tuple[int, ...], dtype: Any, caller: str
    ) -> tuple[PartitionSpec, str]:
        size = math.prod(shape) * dtype.itemsize
        if self.shards == 1:
            why = (
                "no 'shard' axis ('model' splits only what rules name)"
                if self.model > 1
                else ("one device per replica")
            )
            return PartitionSpec(), f"replicated: {why}"
        if not shape:
            return PartitionSpec(), "replicated: a scalar"
        if size < self.min_shard_bytes:
            return (
                PartitionSpec(),
                f"replicated: under min_shard_bytes ({_format_bytes(self.min_shard_bytes)})",
            )
        # The largest dimension that S divides; the first of equal ones.
        by_size = sorted(range(len(shape)), key=lambda d: -shape[d])
        for dimension in by_size:
            if shape[dimension] % self.shards == 0:
                entries: list[str | None] = [None] * len(shape)
                entries[dimension] = SHARD_AXIS
                return PartitionSpec(*entries), f"default: largest dimension {self.shards} divides"
        if name not in self._warned_leaves:
            self._warned_leaves.add(name)
            leaf = f"the leaf {name!r}" if name else "the tree's one leaf"
            rule = f"(({name!r}, PartitionSpec()))" if name else "(('.*', PartitionSpec()))"
            warnings.warn(
                f"{caller}: {leaf} of shape {tuple(shape)} ({_format_bytes(size)}) is replicated on "
                f"every device: no dimension of it divides over {self.shards} devices. Pad it to a "
                f"multiple, or give a layout rule that replicates it on purpose {rule} to silence "
                "this.",
                stacklevel=caller_stacklevel(),
            )
        return PartitionSpec(), f"replicated: no dimension divides by {self.shards}"


def _as_dtype(dtype: Any) -> Any:
    """`dtype` as numpy's, but JAX's own (PRNG keys), which have an itemsize too."""
    try:
        return np.dtype(dtype)
    except TypeError:
        return dtype


def _suffixes(path: Sequence[Any], name: str) -> list[str]:
    """The whole path and each trailing part of it made of whole keys."""
    keys = [_key_name(key) for key in path]
    return ["/".join(keys[i:]) for i in range(len(keys))] or [name]


def _parse_rules(layout: Any, caller: str) -> list[_Rule]:
    if layout is None:
        return []
    usage = "Pass a list of (regex, spec) pairs, such as [('dense.*/kernel', PartitionSpec(None, 'shard'))]."
    if isinstance(layout, str | bytes | dict) or not isinstance(layout, Sequence):
        raise TypeError(f"{caller}: layout must be a list of (regex, spec) pairs; got {layout!r}. {usage}")
    rules = []
    for i, pair in enumerate(layout):
        if not isinstance(pair, tuple | list) or len(pair) != 2 or not isinstance(pair[0], str | re.Pattern):
            raise TypeError(f"{caller}: layout[{i}] must be a (regex, spec) pair; got {pair!r}. {usage}")
        source = pair[0] if isinstance(pair[0], str) else pair[0].pattern
        try:
            pattern = re.compile(source) if isinstance(pair[0], str) else pair[0]  # Its flags kept.
        except re.error as error:
            raise ValueError(f"{caller}: layout[{i}]'s regex {source!r} does not compile: {error}.") from None
        rules.append(
            _Rule(source, pattern, as_spec(pair[1], where=f"layout[{i}] ({source!r})", caller=caller))
        )
    return rules


def as_spec(spec: Any, *, where: str, caller: str) -> PartitionSpec:
    """`spec` (a PartitionSpec, or a tuple or list of its entries) as a PartitionSpec over
    `'shard'` and `'model'`.

    Raises:
      TypeError: it is not a spec.
      ValueError: it names another axis (`'replica'` included), or one axis twice.
    """
    if isinstance(spec, PartitionSpec):
        entries = tuple(spec)
    elif isinstance(spec, tuple | list):
        entries = tuple(spec)
    elif spec is None:
        entries = ()
    else:
        raise TypeError(
            f"{caller}: the spec of {where} must be a PartitionSpec (or a tuple of its entries); "
            f"got {spec!r}."
        )
    entries = tuple(tuple(e) if isinstance(e, list) else e for e in entries)
    names = [n for entry in entries for n in _names(entry)]
    others = sorted({repr(n) for n in names if n not in REPLICA_AXES})
    if others:
        hint = (
            " Replicas always hold their whole model: shard within a replica, over 'shard' or 'model'."
            if "'replica'" in others
            else ""
        )
        raise ValueError(
            f"{caller}: the spec {PartitionSpec(*entries)} of {where} names {', '.join(others)}; a "
            f"ShardedStrategy's leaves are split over {SHARD_AXIS!r} and {MODEL_AXIS!r} only.{hint}"
        )
    twice = sorted({repr(n) for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(
            f"{caller}: the spec {PartitionSpec(*entries)} of {where} names {', '.join(twice)} more "
            "than once; an axis splits one dimension."
        )
    return PartitionSpec(*entries)


def _names(entry: Any) -> tuple[Any, ...]:
    """The axis names in one entry of a spec: None, a name, or a tuple of names."""
    if entry is None:
        return ()
    return tuple(n for n in entry if n is not None) if isinstance(entry, tuple) else (entry,)


def without_axis(spec: PartitionSpec, axis: str) -> PartitionSpec:
    """`spec` with `axis` taken out of every entry (an entry left with no axis becomes None)."""
    entries = []
    for entry in spec:
        kept = tuple(n for n in _names(entry) if n != axis)
        entries.append(None if not kept else kept[0] if len(kept) == 1 else kept)
    return PartitionSpec(*entries)


def _format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


@dataclasses.dataclass(frozen=True)
class LayoutDescription:
    """What `ShardedStrategy.describe_layout` returns: one row per leaf, shown as a table.

    Attributes:
      rows: each leaf's `LeafLayout`, in the tree's order.
      shards: the devices per replica.
      unmatched_rules: the user's rules that decide no leaf of the tree.
    """

    rows: tuple[LeafLayout, ...]
    shards: int
    unmatched_rules: tuple[str, ...] = ()

    @property
    def bytes_per_device(self) -> int:
        """What one device holds of the whole tree."""
        return sum(row.bytes_per_device for row in self.rows)

    @property
    def replicated_bytes(self) -> int:
        """What one device would hold were every leaf replicated (as on `MirroredStrategy`)."""
        return sum(math.prod(row.shape) * row.dtype.itemsize for row in self.rows)

    def __str__(self) -> str:
        header = ("path", "shape", "spec", "per device", "decided by")
        table = [header] + [
            (
                row.path or "(the tree)",
                f"{row.dtype.name}{list(row.shape)}",
                str(tuple(row.spec)) if len(row.spec) else "()",
                _format_bytes(row.bytes_per_device),
                row.reason,
            )
            for row in self.rows
        ]
        widths = [max(len(line[i]) for line in table) for i in range(len(header))]
        lines = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in table
        ]
        lines.insert(1, "  ".join("-" * width for width in widths))
        replicated = self.replicated_bytes
        share = self.bytes_per_device / replicated if replicated else 1.0
        lines.append(
            f"per device: {_format_bytes(self.bytes_per_device)} of {_format_bytes(replicated)} replicated "
            f"({share:.0%}), over {self.shards} devices per replica"
        )
        lines += [f"rule {source!r} matched no leaf" for source in self.unmatched_rules]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return str(self)


def declared_spec(variable: Any, path: str, caller: str) -> tuple[PartitionSpec, str] | None:
    """The spec a Flax NNX Variable declares (`nnx.with_partitioning`), logical names mapped
    through `nnx.logical_axis_rules`; None when it declares none.

    Raises:
      ValueError: it names an axis that is neither `'shard'` nor `'model'` nor mapped to one of
        them (or to None).
    """
    from flax.nnx import spmd  # The caller found Variables: flax is loaded.

    metadata = variable.get_metadata()
    if not metadata.get("out_sharding") and not metadata.get("sharding"):
        return None
    spec = spmd.get_var_pspec(variable)
    if spec is None:
        return None
    names = {n for entry in spec for n in (entry if isinstance(entry, tuple) else (entry,)) if n is not None}
    unknown = sorted(names - set(REPLICA_AXES))
    if unknown:
        raise ValueError(
            f"{caller}: the Flax Variable {path!r} is annotated {tuple(spec)}, naming "
            f"{', '.join(repr(n) for n in unknown)}, which is not an axis a replica's leaves are "
            f"split over ({SHARD_AXIS!r} and {MODEL_AXIS!r}). Map logical names to them: with "
            "nnx.logical_axis_rules([(" + repr(unknown[0]) + ", 'shard'), ...]): around the call, "
            "or annotate with 'shard', 'model' and None."
        )
    # Two logical names mapped to one axis: an error naming the Variable, not JAX's.
    return as_spec(spec, where=f"the Flax Variable {path!r}", caller=caller), "Flax Variable annotation"


def follow_spec(
    path: Sequence[Any],
    shape: tuple[int, ...],
    inputs: Sequence[tuple[Sequence[Any], tuple[int, ...], PartitionSpec]],
) -> tuple[PartitionSpec, str] | None:
    """The spec of the input an output follows: the one with the longest path that the output's
    path ends with, among those of the output's shape; None when none."""
    keys = [_key_name(key) for key in path]
    best: tuple[int, PartitionSpec, str] | None = None
    for input_path, input_shape, spec in inputs:
        if tuple(input_shape) != tuple(shape):
            continue
        input_keys = [_key_name(key) for key in input_path]
        n = len(input_keys)
        if n <= len(keys) and keys[len(keys) - n :] == input_keys and (best is None or n > best[0]):
            best = (n, spec, "/".join(input_keys) or "an argument")
    return None if best is None else (best[1], f"input {best[2]!r}")
