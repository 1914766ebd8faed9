"""Each private JAX API in `jax_compat` resolves on the installed JAX, and each fallback works.

A JAX upgrade that moves or deprecates one of them fails `test_resolves_through_its_first_path`
by name; the other tests take the first path away and check what happens then.
"""

from __future__ import annotations

import importlib
import sys
import types
import warnings

import jax
import jax.numpy as jnp
import pytest

from jaxstrategy._src.core import jax_compat

ENTRIES = {
    "tracer": jax_compat.TRACER_PATHS,
    "array_type": jax_compat.ARRAY_TYPE_PATHS,
    "backends_are_initialized": jax_compat.BACKENDS_ARE_INITIALIZED_PATHS,
    "backends_cache": jax_compat.BACKENDS_CACHE_PATHS,
    "cluster_types": jax_compat.CLUSTER_TYPES_PATHS,
    "distributed_state": jax_compat.DISTRIBUTED_STATE_PATHS,
    "traceback_exclusion": jax_compat.TRACEBACK_EXCLUSION_PATHS,
}


def _take_away(monkeypatch: pytest.MonkeyPatch, path: str) -> None:
    """Delete the first attribute of `path` from its module, as a JAX that moved it would."""
    module_name, _, attributes = path.partition(":")
    monkeypatch.delattr(importlib.import_module(module_name), attributes.split(".")[0])


@pytest.mark.parametrize("paths", ENTRIES.values(), ids=ENTRIES.keys())
def test_resolves_through_its_first_path(paths):
    found = jax_compat.resolve(paths)
    assert found is not None, f"JAX {jax.__version__} has none of {paths}: update jax_compat.py"
    assert found[0] == paths[0], f"JAX {jax.__version__} moved {paths[0]}: update jax_compat.py"


@pytest.mark.parametrize("paths", ENTRIES.values(), ids=ENTRIES.keys())
def test_each_later_path_is_tried_when_the_first_is_gone(monkeypatch, paths):
    _take_away(monkeypatch, paths[0])
    found = jax_compat.resolve(paths)
    if len(paths) == 1:
        assert found is None
    else:
        assert found is not None and found[0] == paths[1]


def test_resolve_skips_missing_modules_attributes_and_deprecated_names(monkeypatch):
    deprecated = types.ModuleType("fake_deprecating_jax")

    def module_getattr(name):
        if name == "Thing":
            warnings.warn("fake_deprecating_jax.Thing is deprecated", DeprecationWarning, stacklevel=2)
            return object()
        raise AttributeError(name)

    deprecated.__getattr__ = module_getattr  # type: ignore[method-assign]
    current = types.ModuleType("fake_current_jax")
    current.Thing = "current"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fake_deprecating_jax", deprecated)
    monkeypatch.setitem(sys.modules, "fake_current_jax", current)
    paths = ("no_such_module_anywhere:Thing", "fake_current_jax:Other", "fake_deprecating_jax:Thing")
    assert jax_compat.resolve(paths) is None
    assert jax_compat.resolve((*paths, "fake_current_jax:Thing")) == ("fake_current_jax:Thing", "current")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # The deprecation was recorded, not shown.
        jax_compat.resolve(paths)


def test_tracer_is_jax_core_tracer_and_is_tracer_tells_traced_values():
    assert jax_compat.Tracer is jax.core.Tracer
    seen = []
    jax.jit(lambda x: seen.append(jax_compat.is_tracer(x)) or x)(jnp.ones(2))
    assert seen == [True]
    assert not jax_compat.is_tracer(jnp.ones(2))
    assert not jax_compat.is_tracer(1.0)


def test_array_type_is_the_class_of_jax_arrays():
    assert jax_compat.ARRAY_TYPE is type(jax.numpy.zeros(()))


def test_tracer_falls_back_to_where_jax_defines_it(monkeypatch):
    from jax._src import core

    _take_away(monkeypatch, jax_compat.TRACER_PATHS[0])
    assert jax_compat.resolve_tracer() is core.Tracer


def test_tracer_found_nowhere_is_an_import_error_naming_the_jax_version(monkeypatch):
    for path in jax_compat.TRACER_PATHS:
        _take_away(monkeypatch, path)
    with pytest.raises(ImportError, match=rf"JAX {jax.__version__} has no tracer class at any of"):
        jax_compat.resolve_tracer()


def test_backends_started_once_an_array_exists():
    jnp.zeros(1).block_until_ready()
    assert jax_compat.backends_started() is True


def test_backends_started_falls_back_to_the_backends_cache_then_to_false(monkeypatch):
    jnp.zeros(1).block_until_ready()
    _take_away(monkeypatch, jax_compat.BACKENDS_ARE_INITIALIZED_PATHS[0])
    monkeypatch.setattr(
        jax_compat, "_backends_are_initialized", jax_compat.resolve(jax_compat.BACKENDS_ARE_INITIALIZED_PATHS)
    )
    assert jax_compat.backends_started() is True  # Read from the cache.
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "_backends", {})  # As JAX's _clear_backends rebinds it.
    assert jax_compat.backends_started() is False  # The cache in use, not the one found at import.
    monkeypatch.setattr(jax_compat, "_backends_cache", None)
    assert jax_compat.backends_started() is False  # Cannot tell: JAX's initialize checks itself.


class _Present:
    opt_in_only_method = False

    @staticmethod
    def is_env_present():
        warnings.warn("a client library is missing", UserWarning, stacklevel=1)
        return True


class _OptInOnly(_Present):
    opt_in_only_method = True


class _Absent(_Present):
    @staticmethod
    def is_env_present():
        return False


class _Unknown:  # A registered environment without the expected interface.
    pass


def test_detected_cluster_is_none_on_this_machine():
    assert jax_compat.detected_cluster() is None


def test_detected_cluster_names_the_first_environment_present(monkeypatch):
    environments = [_Unknown, _OptInOnly, _Absent, _Present]
    monkeypatch.setattr(jax_compat, "_cluster_types", ("fake", environments))
    assert jax_compat.detected_cluster() == "_Present"  # Its warning was silenced.


def test_detected_cluster_detects_nothing_where_jax_keeps_no_environments(monkeypatch):
    for path in jax_compat.CLUSTER_TYPES_PATHS:
        _take_away(monkeypatch, path)
    monkeypatch.setattr(jax_compat, "_cluster_types", jax_compat.resolve(jax_compat.CLUSTER_TYPES_PATHS))
    assert jax_compat.detected_cluster() is None


def test_distributed_state_before_initialize():
    assert jax_compat.coordination_client() is None
    assert jax_compat.coordinator_address() is None


def test_distributed_state_found_nowhere_is_a_clear_error(monkeypatch):
    _take_away(monkeypatch, jax_compat.DISTRIBUTED_STATE_PATHS[0])
    monkeypatch.setattr(
        jax_compat, "_distributed_state", jax_compat.resolve(jax_compat.DISTRIBUTED_STATE_PATHS)
    )
    for reach in (jax_compat.coordination_client, jax_compat.coordinator_address):
        with pytest.raises(
            RuntimeError, match=rf"cannot reach JAX's distributed runtime: JAX {jax.__version__}"
        ):
            reach()


def test_an_error_in_a_step_skips_the_frames_of_runs_wrappers(monkeypatch):
    # Issue 28, item 5: a tracing error pointed at _src/steps/spmd.py ("blocks[4]"), between the
    # user's call and the user's step.
    import traceback

    import jaxstrategy

    monkeypatch.setenv("JAX_TRACEBACK_FILTERING", "auto")
    strategy = jaxstrategy.MirroredStrategy()

    def step(x):
        return x @ jnp.ones((3, 4))

    with pytest.raises(TypeError) as raised:
        strategy.run(step, args=(jnp.ones(5),))
    frames = [frame.filename for frame in traceback.extract_tb(raised.value.__traceback__)]
    assert any(name == __file__ for name in frames)
    assert not any(name.endswith(("spmd.py", "per_replica.py")) for name in frames), frames
