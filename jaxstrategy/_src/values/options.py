"""`RunOptions`, `InputOptions` and `InputReplicationMode`: frozen, validated on construction.

TensorFlow's options are namedtuples; these are frozen dataclasses with the same field names,
defaults and keyword construction, compared by value. Copy one with a field changed through
`dataclasses.replace`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

from jaxstrategy._src.core.arguments import CaseInsensitiveEnum, as_index, check_int

# What `InputOptions.partial_batch` accepts.
PARTIAL_BATCH_POLICIES = ("error", "drop", "pad")


class InputReplicationMode(CaseInsensitiveEnum):
    """How input pipelines map to replicas.

    `PER_WORKER`: one pipeline per worker process feeds all its replicas (the default).
    `PER_REPLICA`: one pipeline per replica; only `distribute_datasets_from_function` of a
    multi-replica strategy supports it.

    Example:
      >>> import jaxstrategy
      >>> [mode.name for mode in jaxstrategy.InputReplicationMode]
      ['PER_WORKER', 'PER_REPLICA']
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclasses.dataclass(frozen=True)
class InputOptions:
    """How a distributed dataset moves batches to the device(s).

    Attributes:
      experimental_fetch_to_device: put batches on the strategy's device(s) (True, the default;
        None means True), or yield them as host numpy arrays (False).
      experimental_replication_mode: an `InputReplicationMode` or its name.
      experimental_place_dataset_on_device: kept for TensorFlow compatibility; JAX has no
        on-device dataset ops, so it may only be set together with `PER_REPLICA` and
        `experimental_fetch_to_device=False`, as TensorFlow requires.
      experimental_per_replica_buffer_size: how many batches a background thread keeps in flight
        on the device. 2 (double buffering) hides one transfer behind each step; 0 turns the
        thread off and places each batch on demand. None (the default) chooses: 2, except on CPU
        devices with a source already in memory (a list, tuple or numpy array) in a job of one
        process, where it is 0.
        There the copy is CPU work that a thread would run while the step computes, on the same
        cores, so it gains nothing (docs/performance.md, "Against Keras `fit` and a bare loop").
        TensorFlow's default is 1.
      partial_batch: what to do with a batch that cannot be split evenly over the replicas (one
        SPMD program needs the same shape on every replica), such as a short last batch on a
        strategy with several replicas. 'error' (the default) raises, naming the batch's size;
        'drop' skips the batch with a warning that counts its examples; 'pad' pads it with zeros
        and makes every element a `(batch, mask)` pair, where `mask` is a boolean array with one
        entry per example, True for real ones (per replica on a multi-replica strategy), so the
        step can weight its loss by it. TensorFlow instead gives the last replicas fewer (or
        no) examples.

    Example:
      >>> import jaxstrategy
      >>> options = jaxstrategy.InputOptions(experimental_fetch_to_device=None)
      >>> options.experimental_fetch_to_device, options.experimental_per_replica_buffer_size
      (True, None)
    """

    experimental_fetch_to_device: bool | None = True
    experimental_replication_mode: InputReplicationMode | str = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int | None = None
    partial_batch: str = "error"

    def __post_init__(self) -> None:
        fetch = self.experimental_fetch_to_device
        _check_bool("InputOptions", "experimental_fetch_to_device", fetch, allow_none=True)
        object.__setattr__(self, "experimental_fetch_to_device", True if fetch is None else fetch)
        mode = self.experimental_replication_mode
        try:
            mode = InputReplicationMode(mode)
        except ValueError:
            raise ValueError(
                f"InputOptions(experimental_replication_mode={mode!r}): expected an "
                "InputReplicationMode or one of 'PER_WORKER', 'PER_REPLICA'."
            ) from None
        object.__setattr__(self, "experimental_replication_mode", mode)
        on_device = self.experimental_place_dataset_on_device
        _check_bool("InputOptions", "experimental_place_dataset_on_device", on_device)
        if on_device and (mode is not InputReplicationMode.PER_REPLICA or self.experimental_fetch_to_device):
            raise ValueError(
                "InputOptions(experimental_place_dataset_on_device=True) needs "
                "experimental_replication_mode=InputReplicationMode.PER_REPLICA and "
                "experimental_fetch_to_device=False, as in TensorFlow."
            )
        size = self.experimental_per_replica_buffer_size
        sizes = "0 turns prefetching off; 2 double-buffers"
        check_int(
            size,
            f"InputOptions(experimental_per_replica_buffer_size={size!r})",
            at_least=0,
            allow_none=True,
            expected=f"an int >= 0 ({sizes}), or None to let the dataset choose",
        )
        if self.partial_batch not in PARTIAL_BATCH_POLICIES:
            raise ValueError(
                f"InputOptions(partial_batch={self.partial_batch!r}): expected one of "
                f"{', '.join(map(repr, PARTIAL_BATCH_POLICIES))}."
            )


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """Options for `Strategy.run`.

    TensorFlow's three fields are accepted and have no effect, as in TensorFlow on anything but
    TPUs (JAX compiles for the shapes it is given). Two pairs of fields come from `jax.jit`:

    - `donate_argnums` and `donate_argnames`: the named arguments' arrays are given to the
      computation to reuse for its outputs (and deleted), which saves memory when a step replaces
      its state. An array passed to a donated argument may not be passed anywhere else in the
      same call, neither as itself nor as another array over the same device buffer (two
      `jax.device_put`s of one array; `Strategy.put` never makes such arrays): that is a
      `ValueError` naming both places, where XLA would refuse the call on one device and crash
      the process on several. A donated Flax NNX object gives up its Variables' arrays and holds the new ones.
      Do not donate a batch a dataset delivered as it is (jax arrays already on the device): the
      dataset hands out the same arrays at its next pass.
    - `static_argnums` and `static_argnames`: the named arguments are compile-time constants even
      where they are numbers (a `training=True` flag that Python code branches on); each new
      value compiles the function once more. They must be hashable.

    Attributes:
      experimental_enable_dynamic_batch_size: accepted for TensorFlow compatibility; no effect.
      experimental_bucketizing_dynamic_shape: accepted for TensorFlow compatibility; no effect.
      experimental_xla_options: accepted for TensorFlow compatibility; no effect.
      donate_argnums: positions in `args` whose arrays are donated (an int or a sequence).
      donate_argnames: names in `kwargs` whose arrays are donated (a str or a sequence).
      static_argnums: positions in `args` that are compile-time constants.
      static_argnames: names in `kwargs` that are compile-time constants.

    Raises:
      TypeError, ValueError: a field of the wrong type or value; an argument both donated and
        static.

    Example:
      >>> import jaxstrategy
      >>> jaxstrategy.RunOptions(donate_argnums=0).donate_argnums
      (0,)
      >>> def step(x, training):
      ...     return x * 0.5 if training else x
      >>> options = jaxstrategy.RunOptions(static_argnames='training')
      >>> strategy = jaxstrategy.OneDeviceStrategy()
      >>> strategy.run(step, args=(4.0,), kwargs={'training': True}, options=options).tolist()
      2.0
    """

    experimental_enable_dynamic_batch_size: bool = True
    experimental_bucketizing_dynamic_shape: bool = False
    experimental_xla_options: Any = None
    donate_argnums: int | Sequence[int] = ()
    donate_argnames: str | Sequence[str] = ()
    static_argnums: int | Sequence[int] = ()
    static_argnames: str | Sequence[str] = ()

    def __post_init__(self) -> None:
        _check_bool(
            "RunOptions",
            "experimental_enable_dynamic_batch_size",
            self.experimental_enable_dynamic_batch_size,
        )
        _check_bool(
            "RunOptions",
            "experimental_bucketizing_dynamic_shape",
            self.experimental_bucketizing_dynamic_shape,
        )
        for field in ("donate_argnums", "static_argnums"):
            object.__setattr__(self, field, _as_argnums(field, getattr(self, field)))
        for field in ("donate_argnames", "static_argnames"):
            object.__setattr__(self, field, _as_argnames(field, getattr(self, field)))
        both = sorted(set(self.donate_argnums) & set(self.static_argnums)) or sorted(  # type: ignore[arg-type]
            set(self.donate_argnames) & set(self.static_argnames)  # type: ignore[arg-type]
        )
        if both:
            raise ValueError(
                f"RunOptions: argument(s) {both} are both donated and static; a compile-time "
                "constant has no buffer to donate. Remove them from one of the two."
            )


def _check_bool(owner: str, field: str, value: Any, *, allow_none: bool = False) -> None:
    if isinstance(value, bool) or (allow_none and value is None):
        return
    expected = "True, False or None" if allow_none else "True or False"
    raise TypeError(f"{owner}({field}={value!r}): expected {expected}.")


def _as_argnums(field: str, value: Any) -> tuple[int, ...]:
    items = (value,) if isinstance(value, int) else value
    try:
        if isinstance(items, str):
            raise TypeError
        numbers = tuple(sorted({as_index(i) for i in items}))
    except TypeError:
        raise TypeError(f"RunOptions({field}={value!r}): expected an int or a sequence of ints.") from None
    if any(n < 0 for n in numbers):
        raise ValueError(f"RunOptions({field}={value!r}): positions must be >= 0.")
    return numbers


def _as_argnames(field: str, value: Any) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else value
    if isinstance(items, Iterable):
        names = tuple(items)
        if all(isinstance(n, str) for n in names):
            return tuple(sorted(set(names)))
    raise TypeError(f"RunOptions({field}={value!r}): expected a str or a sequence of strs.")
