"""Bound how many step programs one strategy has queued: `StepCache`'s hook for CPU meshes.

XLA's CPU client deadlocks in a collective's rendezvous when many multi-device programs are
queued (measured: 2 forced devices, a psum per step, 48 steps in flight hung, 32 did not). Waiting
for every n-th step's outputs bounds the queue at little cost. Accelerators queue programs on
their own streams and need no bound, so only `MirroredStrategy` on several CPU devices uses this.
"""

from __future__ import annotations

import itertools
import operator
import threading
from collections.abc import Callable
from typing import Any

import jax

from jaxstrategy._src.core.types import PyTree


class InFlightLimit:
    """Wraps step calls so that every `wait_every`-th call waits for its outputs before returning.

    One thread at a time dispatches and counts, so the bound holds for the strategy whatever the
    number of threads calling `run`: with the count per thread, 8 threads on 2 CPU devices queued
    enough programs for the rendezvous to abort the process (measured, jax 0.10.2).

    Example:
      >>> limit = InFlightLimit(wait_every=2)
      >>> double = limit.wrap(lambda x: x * 2)
      >>> [int(double(jax.numpy.int32(i))) for i in range(3)]
      [0, 2, 4]
    """

    def __init__(self, wait_every: int):
        self._wait_every = wait_every
        self._calls_since_wait = 0
        # Reentrant, so that a step that (wrongly) calls run again gets run's error, not a hang.
        self._lock = threading.RLock()

    def wrap(self, call: Callable[..., PyTree]) -> Callable[..., PyTree]:
        """`call`, made one thread at a time, waiting for every `wait_every`-th call's outputs."""

        def limited(*args: Any, **kwargs: Any) -> PyTree:
            with self._lock:
                outputs = call(*args, **kwargs)
                self._calls_since_wait += 1
                if self._calls_since_wait >= self._wait_every:
                    self._calls_since_wait = 0
                    jax.block_until_ready(_one_output_made(outputs, (args, kwargs)))
                return outputs

        return limited


def _one_output_made(outputs: PyTree, inputs: PyTree) -> Any:
    """One leaf of a program's `outputs` that the program made, not one of its `inputs` handed
    back as it was (jit may return an unchanged input itself); None if there is none.

    One program's outputs are all ready when one is (one execution makes them all), and waiting
    on each would cost a microsecond or so per leaf. The leaves are compared by identity in C.
    """
    output_leaves = jax.tree.leaves(outputs)
    input_ids = set(map(id, jax.tree.leaves(inputs)))
    made = list(
        itertools.compress(
            output_leaves, map(operator.not_, map(input_ids.__contains__, map(id, output_leaves)))
        )
    )
    return made[-1] if made else None
