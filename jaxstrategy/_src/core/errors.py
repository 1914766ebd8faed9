"""The exceptions jaxstrategy raises, and the helpers that format their messages.

A message starts with the public call that failed, as the user wrote it: a method with its class
(`MirroredStrategy.run()`), a constructor (`ShardedStrategy()`), a function by its public path
(`jaxstrategy.checkpoint.save()`). Functions that word messages for a call take it as `caller`, in
that form and no other; a message about one argument writes it inside the parentheses with
`format_call`, as in `ShardedStrategy(devices=[...]): ...`.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import jax


class JaxStrategyError(Exception):
    """Base class of every exception defined by jaxstrategy."""


class InvalidDeviceError(JaxStrategyError, ValueError):
    """A device argument names no device this process has, or cannot be parsed."""


class StrategyContextError(JaxStrategyError, RuntimeError):
    """A call made in the wrong context: another strategy's scope, or inside `run`."""


def format_call(caller: str, arguments: str) -> str:
    """`caller` (a call such as `'ShardedStrategy()'`) with `arguments` written between its parentheses.

    Example:
      >>> format_call("MultiWorkerMirroredStrategy()", "cluster_resolver=None")
      'MultiWorkerMirroredStrategy(cluster_resolver=None)'
    """
    if not caller.endswith("()"):
        raise ValueError(f"format_call({caller!r}, ...): expected a call such as 'ShardedStrategy()'.")
    return f"{caller[:-1]}{arguments})"


def format_path(prefix: str, path: Sequence[Any]) -> str:
    """Return a leaf's key path as Python would index it, e.g. `args[0]['w']`."""
    return prefix + jax.tree_util.keystr(tuple(path))


def format_argument_path(path: Sequence[Any]) -> str:
    """Return the key path of a leaf of `(args, kwargs)` as the call's argument, e.g. `args[0]['w']`
    or `kwargs['scale']`."""
    group, rest = path[0], path[1:]
    return format_path("args" if group.idx == 0 else "kwargs", rest)


def bullet_list(lines: Sequence[str]) -> str:
    """Join lines into an indented list, one per line, for multi-problem messages."""
    return "".join(f"\n  {line}" for line in lines)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def caller_stacklevel() -> int:
    """The `stacklevel` for `warnings.warn` that points at the first frame outside jaxstrategy.

    Counting frames by hand breaks whenever a call path gains a layer; this does not.
    """
    frame = sys._getframe(1)  # The function about to call warnings.warn.
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame = frame.f_back  # type: ignore[assignment]
        level += 1
    return level
