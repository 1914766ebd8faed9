"""Helpers shared by the benchmarks (each script puts bench/ on sys.path when run as a file)."""

from __future__ import annotations

import argparse
import collections
import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


def count_compiles() -> collections.Counter[str]:
    """Count XLA backend compiles from now on: a compile inside a timed pass would distort it,
    and a recompile that is not a retrace is caught too."""
    compiles: collections.Counter[str] = collections.Counter()

    def listener(event: str, duration: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles["backend"] += 1

    jax.monitoring.register_event_duration_secs_listener(listener)
    return compiles


def bytes_read() -> int | None:
    """The bytes this process has read so far: `rchar` of `/proc/self/io`; None where that file
    does not exist (it is Linux's).

    `rchar` counts what `read(2)`, `pread(2)` and their kin returned, from the page cache or the
    disk alike (so a restore's bytes are counted whether or not the files were cached), and not
    what is read through `mmap`. Take it before and after a call: the difference is what the
    call read, plus whatever other threads of the process read meanwhile.
    """
    try:
        with open("/proc/self/io") as io:
            lines = io.read().splitlines()
    except OSError:
        return None
    return next(int(line.split()[1]) for line in lines if line.startswith("rchar:"))


def state_bytes_per_device(tree: Any) -> int:
    """The most bytes of `tree`'s arrays that any one device of this process holds, from their
    addressable shards."""
    per_device: collections.Counter[Any] = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values())


# A timed loop: given a number of calls, make them and return the seconds per call.
Loop = Callable[[int], float]

# The loops below take the call to time as a function. Pass both variants of a case the same way
# (each in a lambda, say) so that neither alone pays for an extra Python frame per call.


def call_loop(call: Callable[[], Any], wait_every: int = 0) -> Loop:
    """Time `call()`, waiting for every `wait_every`-th call's output when it is not 0; the timed
    region ends with `jax.block_until_ready` on the last output."""

    def loop(n: int) -> float:
        start = time.perf_counter()
        out = None
        for i in range(n):
            out = call()
            if wait_every and i % wait_every == wait_every - 1:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    return loop


def int_loop(call: Callable[[int], Any], wait_every: int = 0) -> Loop:
    """Time `call(i)` over different Python ints (which trace as weak int32, so a new value does
    not recompile), waiting for every `wait_every`-th call's output when it is not 0.

    The timed region ends with `jax.block_until_ready` on the last output.
    """

    def loop(n: int) -> float:
        start = time.perf_counter()
        out = None
        for i in range(n):
            out = call(i % 100)
            if wait_every and i % wait_every == wait_every - 1:
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        return (time.perf_counter() - start) / n

    return loop


def training_loop(step: Callable[[Any, Any], Any], state: Any, batch: Any, wait_every: int = 0) -> Loop:
    """Time `state, out = step(state, batch)` in a loop, carrying the state between batches as a
    training loop does, and waiting for every `wait_every`-th step when it is not 0.

    The timed region ends with `jax.block_until_ready` on the last state and output.
    """
    carried = {"state": state}

    def loop(n: int) -> float:
        state = carried["state"]
        start = time.perf_counter()
        out = None
        for i in range(n):
            state, out = step(state, batch)
            if wait_every and i % wait_every == wait_every - 1:
                jax.block_until_ready(out)
        jax.block_until_ready((state, out))
        elapsed = time.perf_counter() - start
        carried["state"] = state
        return elapsed / n

    return loop


@dataclasses.dataclass
class Result:
    """The per-call seconds of two variants, `base` and `other`, in every round."""

    name: str
    base: list[float]
    other: list[float]


def measure(name: str, base_loop: Loop, other_loop: Loop, calls: int, rounds: int) -> Result:
    """Time both variants side by side for `rounds` rounds, alternating which goes first."""
    result = Result(name, [], [])
    for round_index in range(rounds):
        gc.collect()
        # A collection inside a timed batch would land on one variant only; timeit does the same.
        gc.disable()
        try:
            if round_index % 2 == 0:
                result.base.append(base_loop(calls))
                result.other.append(other_loop(calls))
            else:
                result.other.append(other_loop(calls))
                result.base.append(base_loop(calls))
        finally:
            gc.enable()
    return result


def percentiles_us(seconds: list[float]) -> tuple[float, float, float]:
    """Return the median, p10 and p90 of per-call seconds, in microseconds."""
    p10, p50, p90 = np.percentile(np.asarray(seconds) * 1e6, [10, 50, 90])
    return float(p50), float(p10), float(p90)


def print_table(results: list[Result], labels: tuple[str, str]) -> list[float]:
    """Print per-call times and other/base ratios; return each case's median per-round ratio.

    `labels` names the base and the other variant, such as ("jit", "run").
    """
    base, other = labels
    print(
        f"{'case':<22}{f'{base} us/call':>26}{f'{other} us/call':>26}"
        f"{f'ratio {other}/{base}':>26}{'ratio of medians':>18}{'ratio p10-p90':>15}"
    )
    medians = []
    for result in results:
        ratios = np.asarray(result.other) / np.asarray(result.base)
        ratio, ratio_p10, ratio_p90 = np.median(ratios), *np.percentile(ratios, [10, 90])
        base50, base10, base90 = percentiles_us(result.base)
        other50, other10, other90 = percentiles_us(result.other)
        base_cell = f"{base50:.2f} ({base10:.1f}-{base90:.1f})"
        other_cell = f"{other50:.2f} ({other10:.1f}-{other90:.1f})"
        print(
            f"{result.name:<22}{base_cell:>26}{other_cell:>26}"
            f"{ratio:>26.3f}{other50 / base50:>18.3f}{f'{ratio_p10:.2f}-{ratio_p90:.2f}':>15}"
        )
        medians.append(float(ratio))
    print(f"us/call: median (p10-p90) over rounds; ratio {other}/{base}: median of the per-round ratios.")
    return medians


def parse_rounds(description: str, *, full: int, quick: int) -> int:
    """The rounds per case from the command line: `--rounds N`, or `--quick` for `quick` rounds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--quick", action="store_true", help=f"a smoke test: {quick} rounds")
    parser.add_argument("--rounds", type=int, help=f"rounds per case (default {full})")
    args = parser.parse_args()
    rounds = args.rounds if args.rounds is not None else quick if args.quick else full
    if rounds < 1:
        parser.error("--rounds must be at least 1")
    return rounds
