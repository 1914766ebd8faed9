"""Checks of plain (non-tree) arguments: ints that are not bools, and names of enum members.

`bool` is a subclass of `int`, so `isinstance(True, int)` holds; an argument that counts things
or indexes them rejects `True` all the same, since passing it is nearly always a mistake (a flag
in the wrong position). Every such check in jaxstrategy goes through `is_int` or `check_int`.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, Literal, TypeGuard, overload

import numpy as np


@overload
def is_int(value: Any, *, numpy: Literal[False] = False) -> TypeGuard[int]: ...


@overload
def is_int(value: Any, *, numpy: bool) -> TypeGuard[int | np.integer[Any]]: ...


def is_int(value: Any, *, numpy: bool = False) -> TypeGuard[int | np.integer[Any]]:
    """Whether `value` is a Python int and not a bool (or, with `numpy`, also a numpy integer)."""
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, bool)


def check_int(
    value: Any,
    label: str,
    *,
    at_least: int | None = None,
    below: int | None = None,
    allow_none: bool = False,
    numpy: bool = False,
    not_int: type[Exception] = ValueError,
    expected: str | None = None,
) -> None:
    """Raise unless `value` is an int, not a bool, in `[at_least, below)` (or None if allowed).

    The message reads `f"{label}: expected {expected}."`, where `label` names the call and the
    argument as the user wrote them (`"Checkpointer(max_to_keep=0)"`) and `expected` defaults to
    the rule: `"an int"`, `"an int >= 1"`, `"an int in [0, 4)"`, `"an int >= 1, or None"`.

    Args:
      value: the argument.
      label: the call and the argument, such as `f"run_local_workers(num_workers={value!r})"`.
      at_least: the smallest value allowed, if any.
      below: the first value too large, if any.
      allow_none: whether None is allowed too.
      numpy: whether a numpy integer counts as an int.
      not_int: the exception for a value that is not an int; one out of range is a ValueError.
      expected: what to say was expected, where the rule alone would say too little.

    Raises:
      `not_int`: `value` is not an int (a bool is not), nor an allowed None.
      ValueError: `value` is an int out of range.

    Example:
      >>> check_int(2, "f(n=2)", at_least=1)
      >>> check_int(True, "f(n=True)", at_least=1)
      Traceback (most recent call last):
      ...
      ValueError: f(n=True): expected an int >= 1.
    """
    if allow_none and value is None:
        return
    if is_int(value, numpy=numpy):
        if (at_least is None or value >= at_least) and (below is None or value < below):
            return
        error: type[Exception] = ValueError
    else:
        error = not_int
    raise error(f"{label}: expected {expected or _rule(at_least, below, allow_none)}.")


def _rule(at_least: int | None, below: int | None, allow_none: bool) -> str:
    if at_least is not None and below is not None:
        rule = f"an int in [{at_least}, {below})"
    elif at_least is not None:
        rule = f"an int >= {at_least}"
    elif below is not None:
        rule = f"an int < {below}"
    else:
        rule = "an int"
    return f"{rule}, or None" if allow_none else rule


def as_index(value: Any) -> int:
    """`value` as an int, for anything with `__index__` (a numpy integer, say) except a bool.

    Raises:
      TypeError: `value` is a bool or has no `__index__`; the caller words the message.
    """
    if isinstance(value, bool):
        raise TypeError(f"expected an int, got the bool {value!r}")
    return operator.index(value)


class CaseInsensitiveEnum(enum.Enum):
    """An enum whose constructor also takes a member's name in any case: `Mode('per_worker')`.

    Example:
      >>> class Color(CaseInsensitiveEnum):
      ...     RED = "RED"
      >>> Color("red"), Color("Red"), Color("RED")
      (<Color.RED: 'RED'>, <Color.RED: 'RED'>, <Color.RED: 'RED'>)
    """

    @classmethod
    def _missing_(cls, value: object) -> Any:
        if isinstance(value, str):
            for name, member in cls.__members__.items():
                if name.casefold() == value.casefold():
                    return member
        return None
