"""Which outputs of a replica's traced function are the same on every replica.

`run` traces its function with `jax.shard_map(..., check_vma=False)` to get TensorFlow's
gradients, and so loses JAX's own account of which values are replicated: `varying_outputs` works
it out again from the traced jaxpr, in one forward pass. docs/internals.md, "Running a step", gives
its rules; tests/steps/test_replication.py checks them case by case on every device's values.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

# Collectives whose result is identical on every replica when they span the whole replica axis.
_REPLICATING_COLLECTIVES = frozenset(
    {"psum", "pmax", "pmin", "all_gather", "all_gather_invariant", "psum_invariant"}
)

# Primitives whose result can differ between replicas even when every input is replicated:
# the replica id, collectives that give each replica its own part, and XLA's stateful RNG.
# Host callbacks and foreign-function calls (by name) and every primitive with side effects
# (mutable arrays' reads and swaps, I/O) are added to these in `_is_variation_source`.
_VARIATION_SOURCES = frozenset(
    {
        "axis_index",
        "ppermute",
        "all_to_all",
        "ragged_all_to_all",
        "reduce_scatter",
        "psum_scatter",
        "rng_uniform",
    }
)

# Call-like primitives: their one jaxpr takes the equation's inputs and gives its outputs, in order.
_CALL_JAXPR_PARAM = {
    "jit": "jaxpr",
    "pjit": "jaxpr",  # The name of `jit` in JAX before 0.7.
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


def varying_outputs(jaxpr: ClosedJaxpr | Jaxpr, varying_inputs: Sequence[bool], axis_name: str) -> list[bool]:
    """For each output of `jaxpr`, whether it may differ between the replicas along `axis_name`.

    Args:
      jaxpr: a replica's function, traced (`jax.make_jaxpr`) where `axis_name` is bound.
      varying_inputs: one flag per input of `jaxpr`: True where replicas get different values.
      axis_name: the replica axis.

    Returns:
      One flag per output: False only where the output is provably the same on every replica.

    Example:
      >>> import jax
      >>> from jax.sharding import Mesh, PartitionSpec as P
      >>> mesh = Mesh(jax.devices()[:2], ('replica',))
      >>> def replica_fn(x, w):
      ...     return x * w, jax.lax.psum(x * w, 'replica'), w + 1
      >>> found = []
      >>> def body(x, w):
      ...     jaxpr = jax.make_jaxpr(replica_fn)(x, w)
      ...     found.extend(varying_outputs(jaxpr, [True, False], 'replica'))
      ...     return x
      >>> _ = jax.shard_map(
      ...     body, mesh=mesh, in_specs=(P('replica'), P()), out_specs=P('replica'),
      ...     check_vma=False)(jax.numpy.ones(2), 1.0)
      >>> found
      [True, False, False]
    """
    return _Analysis(axis_name).outputs(_open(jaxpr), list(varying_inputs))


class _Analysis:
    def __init__(self, axis_name: str):
        self._axis_name = axis_name

    def outputs(self, jaxpr: Jaxpr, varying_inputs: list[bool]) -> list[bool]:
        # Constants of a closed jaxpr, and values closed over, come from outside `run`: replicated.
        varying: dict[Any, bool] = dict.fromkeys(jaxpr.constvars, False)
        varying.update(zip(jaxpr.invars, varying_inputs, strict=True))

        def of(atom: Any) -> bool:
            return False if isinstance(atom, Literal) else varying[atom]

        for eqn in jaxpr.eqns:
            flags = self._equation(eqn, [of(v) for v in eqn.invars])
            varying.update(zip(eqn.outvars, flags, strict=True))
        return [of(v) for v in jaxpr.outvars]

    def _equation(self, eqn: Any, inputs: list[bool]) -> list[bool]:
        name, params, count = eqn.primitive.name, eqn.params, len(eqn.outvars)
        if name in _REPLICATING_COLLECTIVES and self._axis_name in _axis_names(params):
            # Over groups of replicas, each group gets its own result.
            return [params.get("axis_index_groups") is not None] * count
        if self._is_variation_source(eqn):
            return [True] * count
        call_param = _CALL_JAXPR_PARAM.get(name)
        if call_param is not None and call_param in params:
            inner = _open(params[call_param])
            if len(inner.invars) == len(inputs) and len(inner.outvars) == count:
                return self.outputs(inner, inputs)
        if name == "cond":
            return self._cond(params, inputs, count)
        if name == "while":
            return self._while(params, inputs)
        if name == "scan":
            return self._scan(params, inputs)
        return self._unknown(eqn, inputs, count)

    def _cond(self, params: Any, inputs: list[bool], count: int) -> list[bool]:
        index_varies, operands = inputs[0], inputs[1:]
        if index_varies:  # Replicas may take different branches.
            return [True] * count
        flags = [False] * count
        for branch in params["branches"]:
            flags = [a or b for a, b in zip(flags, self.outputs(_open(branch), operands), strict=True)]
        return flags

    def _while(self, params: Any, inputs: list[bool]) -> list[bool]:
        cond_nconsts, body_nconsts = params["cond_nconsts"], params["body_nconsts"]
        cond_consts = inputs[:cond_nconsts]
        body_consts = inputs[cond_nconsts : cond_nconsts + body_nconsts]
        carry = inputs[cond_nconsts + body_nconsts :]
        body, cond = _open(params["body_jaxpr"]), _open(params["cond_jaxpr"])
        carry = self._fixpoint(body, body_consts, carry, [])
        (predicate_varies,) = self.outputs(cond, cond_consts + carry)
        # Replicas that may loop a different number of times may end with different values.
        return [True] * len(carry) if predicate_varies else carry

    def _scan(self, params: Any, inputs: list[bool]) -> list[bool]:
        num_consts, num_carry = params["num_consts"], params["num_carry"]
        consts, carry, xs = (
            inputs[:num_consts],
            inputs[num_consts : num_consts + num_carry],
            inputs[num_consts + num_carry :],
        )
        body = _open(params["jaxpr"])
        carry = self._fixpoint(body, consts, carry, xs)
        ys = self.outputs(body, consts + carry + xs)[num_carry:]
        return carry + ys

    def _fixpoint(self, body: Jaxpr, consts: list[bool], carry: list[bool], xs: list[bool]) -> list[bool]:
        """The carry's flags once a loop body has run any number of times (each pass can only
        turn flags on, so this ends within len(carry) + 1 passes)."""
        while True:
            out = self.outputs(body, consts + carry + xs)[: len(carry)]
            widened = [a or b for a, b in zip(carry, out, strict=True)]
            if widened == carry:
                return carry
            carry = widened

    def _unknown(self, eqn: Any, inputs: list[bool], count: int) -> list[bool]:
        """A primitive this module does not model: element-wise ones (add, dot_general, ...) keep
        their inputs' flag; for one with jaxprs inside, anything inside that can vary spreads."""
        anything_varies = any(inputs) or any(self._may_introduce_variation(j) for j in _jaxprs_in(eqn.params))
        return [anything_varies] * count

    def _may_introduce_variation(self, jaxpr: Jaxpr) -> bool:
        return any(
            self._is_variation_source(eqn)
            or any(self._may_introduce_variation(j) for j in _jaxprs_in(eqn.params))
            for eqn in jaxpr.eqns
        )

    def _is_variation_source(self, eqn: Any) -> bool:
        name = eqn.primitive.name
        if name in _REPLICATING_COLLECTIVES:
            return (
                self._axis_name in _axis_names(eqn.params) and eqn.params.get("axis_index_groups") is not None
            )
        if name in _VARIATION_SOURCES or "callback" in name or "ffi" in name:
            return True  # A host callback or a foreign function may answer differently per device.
        # A side effect (a mutable array written with each replica's value, I/O) may leave each
        # device its own result. A primitive holding jaxprs has its body's effects; the pass
        # follows the body instead.
        return bool(eqn.effects) and not any(True for _ in _jaxprs_in(eqn.params))


def _jaxprs_in(params: Any) -> Iterator[Jaxpr]:
    """The jaxprs among an equation's parameters (`jax.extend.core` has no such helper in every
    JAX this package supports)."""
    for value in params.values():
        for item in value if isinstance(value, tuple) else (value,):
            if isinstance(item, ClosedJaxpr | Jaxpr):
                yield _open(item)


def _open(jaxpr: ClosedJaxpr | Jaxpr) -> Jaxpr:
    return jaxpr.jaxpr if isinstance(jaxpr, ClosedJaxpr) else jaxpr


def _axis_names(params: Any) -> tuple[Any, ...]:
    names = params.get("axes", params.get("axis_name", ()))
    return names if isinstance(names, tuple) else (names,)
