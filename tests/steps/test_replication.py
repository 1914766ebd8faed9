"""replication.py: which outputs of a replica's traced function are the same on every replica.

Each case traces a small function as `run` does (inside `shard_map` with `check_vma=False`, the
first argument a replica's own value, the second the same on every replica) and checks the flag
of each output. A wrong "replicated" would return one replica's value as everyone's; the cases
therefore include every way a value can come to differ.
"""

from __future__ import annotations

import jax
import jax.experimental
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import jaxstrategy
from jaxstrategy import PerReplica
from jaxstrategy._src.steps import replication
from jaxstrategy._src.steps.replication import varying_outputs

AXIS = "replica"


def flags(fn):
    """The varying flag of each output of `fn(own, whole)`, traced on two replicas."""
    mesh = Mesh(np.array(jax.devices()[:2]), (AXIS,))
    found = []

    def body(own, whole):
        traced = jax.make_jaxpr(lambda own, whole: fn(own[0], whole))(own, whole)
        found.extend(varying_outputs(traced, [True, False], AXIS))
        return own

    jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(PartitionSpec(AXIS), PartitionSpec()),
        out_specs=PartitionSpec(AXIS),
        check_vma=False,
    )(jnp.arange(2.0), jnp.float32(1.0))
    return found


def _read_back(value):
    ref = jax.new_ref(jnp.zeros(()))
    ref[...] = value
    return ref[...]


def _swapped_out(value):
    ref = jax.new_ref(jnp.zeros(()))
    ref[...] = value
    return jax.ref.swap(ref, (), jnp.zeros(()))


CASES = {
    "own value": (lambda x, w: x * w, [True]),
    "whole value and constants": (lambda x, w: (w * 2, jnp.ones(3), 4.0), [False, False, False]),
    "collectives over the replicas": (
        lambda x, w: (
            jax.lax.psum(x, AXIS),
            jax.lax.pmean(x, AXIS),
            jax.lax.pmax(x, AXIS),
            jax.lax.pmin(x, AXIS),
            jax.lax.all_gather(x, AXIS),
        ),
        [False] * 5,
    ),
    "replica id": (lambda x, w: jax.lax.axis_index(AXIS) + 1, [True]),
    "ppermute of a whole value": (lambda x, w: jax.lax.ppermute(w, AXIS, [(0, 1)]), [True]),
    "psum_scatter of a whole value": (
        lambda x, w: jax.lax.psum_scatter(jnp.stack([w, w]), AXIS, tiled=True),
        [True],
    ),
    "reduction over groups of replicas": (
        lambda x, w: jax.lax.psum(x, AXIS, axis_index_groups=[[0], [1]]),
        [True],
    ),
    "host callback of a whole value": (
        lambda x, w: jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), w),
        [True],
    ),
    "a mutable array a replica wrote into": (lambda x, w: (_read_back(x), _swapped_out(x)), [True, True]),
    "host callbacks and XLA's stateful random numbers": (
        lambda x, w: (
            jax.experimental.io_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), w),
            jax.lax.rng_uniform(jnp.float32(0), jnp.float32(1), (2,)),
        ),
        [True, True],
    ),
    "random numbers from a whole key, and from one folded with the replica id": (
        lambda x, w: (
            jax.random.normal(jax.random.key(0)),
            jax.random.normal(jax.random.fold_in(jax.random.key(0), jax.lax.axis_index(AXIS))),
        ),
        [False, True],
    ),
    "collective inside a nested jit": (lambda x, w: jax.jit(lambda v: jax.lax.psum(v, AXIS))(x), [False]),
    "replica id inside a nested jit": (
        lambda x, w: jax.jit(lambda v: v + jax.lax.axis_index(AXIS))(1),
        [True],
    ),
    "remat and custom rules": (
        lambda x, w: (
            jax.checkpoint(lambda v: jax.lax.psum(v, AXIS))(x),
            jax.nn.relu(x),  # custom_jvp
            jax.nn.relu(w),
            jax.checkpoint(lambda v: v * 2)(x),
        ),
        [False, True, False, True],
    ),
    "gradients through collectives": (
        lambda x, w: (jax.grad(lambda w: jax.lax.psum(w * x, AXIS))(w), jax.grad(lambda w: w * 3)(w)),
        [True, False],
    ),
    "cond on a whole predicate": (
        lambda x, w: (
            jax.lax.cond(w > 0, lambda: w, lambda: w + 1),
            jax.lax.cond(w > 0, lambda: w, lambda: x),
        ),
        [False, True],
    ),
    "cond on a replica's predicate": (lambda x, w: jax.lax.cond(x > 0, lambda: w, lambda: w + 1), [True]),
    # The rotation takes three passes to carry the replica's value into the first slot.
    "while loop to a fixpoint": (
        lambda x, w: jax.lax.while_loop(
            lambda c: c[3] < 5, lambda c: (c[1], c[2], x, c[3] + 1), (w, w, w, 0)
        ),
        [True, True, True, False],
    ),
    "while loop whose trip count varies": (
        lambda x, w: jax.lax.while_loop(lambda c: c[0] < x, lambda c: (c[0] + 1, c[1] * 2), (w, w)),
        [True, True],
    ),
    "while loop of whole values only": (
        lambda x, w: jax.lax.while_loop(lambda c: c < 5, lambda c: c + w, w),
        [False],
    ),
    "scan to a fixpoint, and its stacked outputs": (
        lambda x, w: jax.lax.scan(lambda c, i: ((c[1], x + i), c[0] * i), (w, w), jnp.arange(3.0)),
        [True, True, True],
    ),
    "scan of whole values": (
        lambda x, w: jax.lax.scan(lambda c, i: (c + i * w, c), w, jnp.arange(3.0)),
        [False, False],
    ),
    "scan over a replica's values": (
        lambda x, w: jax.lax.scan(lambda c, i: (c, i), w, jnp.stack([x, x])),
        [False, True],
    ),
}


@pytest.mark.parametrize("fn, expected", CASES.values(), ids=CASES.keys())
def test_outputs_vary_exactly_where_replicas_can_differ(fn, expected):
    assert flags(fn) == expected


# Cases XLA cannot run on CPU devices.
_NOT_RUNNABLE = {"reduction over groups of replicas"}


@pytest.mark.parametrize("name", [name for name in CASES if name not in _NOT_RUNNABLE])
def test_what_run_returns_replicated_is_the_same_on_every_device(name, cpu_devices):
    # End to end: every output run returns as one array must hold equal copies on the devices.
    fn, expected = CASES[name]
    strategy = jaxstrategy.MirroredStrategy(cpu_devices[:2])
    own = strategy.experimental_distribute_values_from_function(
        lambda context: jnp.float32(context.replica_id_in_sync_group)
    )
    outputs = jax.tree.leaves(
        strategy.run(fn, args=(own, strategy.put(jnp.float32(1.0)))),
        is_leaf=lambda x: isinstance(x, PerReplica),
    )
    assert [isinstance(out, PerReplica) for out in outputs] == expected
    for out in outputs:
        if not isinstance(out, PerReplica):
            copies = [
                np.asarray(
                    jax.random.key_data(s.data)
                    if jnp.issubdtype(s.data.dtype, jax.dtypes.prng_key)
                    else s.data
                )
                for s in out.addressable_shards
            ]
            assert all(np.array_equal(copies[0], copy) for copy in copies[1:]), name


def test_a_primitive_it_does_not_model_varies_with_its_inputs_or_what_it_holds(monkeypatch):
    # As if `jit` were unknown: sound, if less precise.
    monkeypatch.setattr(replication, "_CALL_JAXPR_PARAM", {})
    assert flags(lambda x, w: jax.jit(lambda v: v + 1)(w)) == [False]
    assert flags(lambda x, w: jax.jit(lambda v: v + jax.lax.axis_index(AXIS))(1)) == [True]
    assert flags(lambda x, w: jax.jit(lambda v: jax.lax.psum(v, AXIS))(x)) == [True]


def test_run_returns_the_replica_s_own_value_for_what_varies(cpu_devices):
    strategy = jaxstrategy.MirroredStrategy(cpu_devices[:2])
    key = strategy.put(jax.random.key(0))

    def step(key):
        replica = jaxstrategy.get_replica_context().replica_id_in_sync_group
        own = jax.random.normal(jax.random.fold_in(key, replica))
        laps = jax.lax.while_loop(lambda c: c[0] < replica + 1, lambda c: (c[0] + 1, c[1] * 2.0), (0, 1.0))
        return jax.random.normal(key), own, laps[1]

    shared, own, laps = strategy.run(step, args=(key,))
    assert not isinstance(shared, PerReplica)
    assert isinstance(own, PerReplica) and isinstance(laps, PerReplica)
    own_values = [float(v) for v in strategy.experimental_local_results(own)]
    assert own_values[0] != own_values[1]
    assert [float(v) for v in strategy.experimental_local_results(laps)] == [2.0, 4.0]
