"""Every private JAX API jaxstrategy uses, each reached through the places it has been seen.

Private paths may move in any JAX release, so each entry lists the paths it may be found at, the
preferred first, tagged with the JAX versions seen having it, and says what happens where none
resolves. A path that raises a `DeprecationWarning` does not resolve. Everything resolves once, at
import; tests/core/test_jax_compat.py checks each first path. docs/internals.md, "Values", tells
the rules and why.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import jax

# JAX's tracer class. `jax.core.Tracer`: public, and not deprecated, in 0.10.2, 0.11.2 and
# 0.12.0.1 (their `jax.core` deprecates other names only). `jax._src.core.Tracer`: where those
# versions define it, for a JAX that deprecates or drops the public name.
TRACER_PATHS = ("jax.core:Tracer", "jax._src.core:Tracer")

# The class of JAX's concrete arrays, for checks by exact type: in 0.10.2 to 0.12.0.1.
ARRAY_TYPE_PATHS = ("jax._src.array:ArrayImpl",)

# JAX's own check, which `jax.distributed.initialize` makes first thing: in 0.10.2 to 0.12.0.1.
BACKENDS_ARE_INITIALIZED_PATHS = ("jax._src.xla_bridge:backends_are_initialized",)
# The backends' cache, which that check reads (in the same versions): for a JAX that drops the
# check but keeps the cache.
BACKENDS_CACHE_PATHS = ("jax._src.xla_bridge:_backends",)

# The cluster environments `jax.distributed.initialize()` tries, in registration order: the
# registry `ClusterEnv._cluster_types`, of the class that `jax._src.clusters` re-exports and
# `jax._src.clusters.cluster` defines, both in 0.10.2 to 0.12.0.1.
CLUSTER_TYPES_PATHS = (
    "jax._src.clusters:ClusterEnv._cluster_types",
    "jax._src.clusters.cluster:ClusterEnv._cluster_types",
)

# The distributed runtime's state, with `coordinator_address` and `client`: in 0.10.2 to
# 0.12.0.1 (where orbax and `jax.experimental.multihost_utils` read it too).
DISTRIBUTED_STATE_PATHS = ("jax._src.distributed:global_state",)

# JAX's list of source paths whose frames it leaves out of the tracebacks it filters (its own),
# which libraries built on it add themselves to (equinox does): in 0.10.2 to 0.12.0.1.
TRACEBACK_EXCLUSION_PATHS = ("jax._src.traceback_util:register_exclusion",)


def resolve(paths: Sequence[str]) -> tuple[str, Any] | None:
    """The first of `paths` (`'module:attribute.attribute'`) that resolves, with what it names.

    A path resolves when its module imports and each attribute exists, without a
    `DeprecationWarning`. Returns None when none does.
    """
    for path in paths:
        module_name, _, attributes = path.partition(":")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", DeprecationWarning)
            try:
                found: Any = importlib.import_module(module_name)
                for attribute in attributes.split("."):
                    found = getattr(found, attribute)
            except (ImportError, AttributeError):
                continue
        if not any(issubclass(w.category, DeprecationWarning) for w in caught):
            return path, found
    return None


def resolve_tracer() -> type:
    """JAX's tracer class.

    Raises:
      ImportError: this JAX has it at none of `TRACER_PATHS`. No fallback is safe: a tracer taken
        for a concrete array would be placed on devices and read.
    """
    found = resolve(TRACER_PATHS)
    if found is None:
        raise ImportError(
            f"jaxstrategy: JAX {jax.__version__} has no tracer class at any of {list(TRACER_PATHS)}, "
            "where JAX 0.10 to 0.12 keep it, and jaxstrategy needs it to tell traced values from "
            "concrete ones. Install a JAX version that jaxstrategy supports (see its pyproject.toml)."
        )
    cls: type = found[1]
    return cls


Tracer = resolve_tracer()

# None where no path resolves: `tree_checks` then learns the type from the first array it meets.
_array_type = resolve(ARRAY_TYPE_PATHS)
ARRAY_TYPE: type | None = None if _array_type is None else _array_type[1]

_backends_are_initialized = resolve(BACKENDS_ARE_INITIALIZED_PATHS)
_backends_cache = resolve(BACKENDS_CACHE_PATHS)
_cluster_types = resolve(CLUSTER_TYPES_PATHS)
_distributed_state = resolve(DISTRIBUTED_STATE_PATHS)
_traceback_exclusion = resolve(TRACEBACK_EXCLUSION_PATHS)


def hide_frames_under(directory: str) -> bool:
    """Have JAX leave the frames of files under `directory` out of the tracebacks it filters, as
    it leaves out its own: an error in a user's step then points at the user's code, not at the
    library's wrappers around it (`JAX_TRACEBACK_FILTERING=off` shows every frame). Returns
    whether this JAX could be told; where not, the frames stay, which is only noisier."""
    if _traceback_exclusion is None:
        return False
    _traceback_exclusion[1](directory)
    return True


def is_tracer(x: Any) -> bool:
    """Whether `x` is a traced value (under `jax.jit`, `grad`, `vmap`, `shard_map`...)."""
    return isinstance(x, Tracer)


def backends_started() -> bool:
    """Whether JAX's backend runs in this process (a process then cannot join a job).

    False where this JAX has neither the check nor the cache it reads: that cannot be told, and
    `jax.distributed.initialize` then raises its own error, as it makes the same check.
    """
    if _backends_are_initialized is not None:
        return bool(_backends_are_initialized[1]())
    if _backends_cache is not None:
        # Read anew: JAX rebinds the cache (`xla_bridge._clear_backends`), so the dict found at
        # import may no longer be the one in use.
        module_name, _, attribute = _backends_cache[0].partition(":")
        return bool(getattr(sys.modules[module_name], attribute, None))
    return False


def detected_cluster() -> str | None:
    """The name of the cluster environment `jax.distributed.initialize()` would detect, or None.

    None too where this JAX keeps its environments elsewhere: it cannot detect any, and every
    process then trains alone, as when none is detected; TF_CONFIG and the cluster resolvers do
    not depend on it.
    """
    if _cluster_types is None:
        return None
    for environment in list(_cluster_types[1]):
        is_env_present = getattr(environment, "is_env_present", None)
        if getattr(environment, "opt_in_only_method", False) or is_env_present is None:
            continue
        with warnings.catch_warnings():
            # Kubernetes' check warns when its client library is missing; it then detects
            # nothing, as `jax.distributed.initialize()` would, and every pod trains alone.
            warnings.simplefilter("ignore")
            present = is_env_present()
        if present:
            return str(environment.__name__)
    return None


def _distributed() -> Any:
    if _distributed_state is None:
        raise RuntimeError(
            f"jaxstrategy: cannot reach JAX's distributed runtime: JAX {jax.__version__} keeps its "
            f"state at none of {list(DISTRIBUTED_STATE_PATHS)}, where JAX 0.10 to 0.12 keep it, and "
            "a job of several processes needs it. Install a JAX version that jaxstrategy supports "
            "(see its pyproject.toml), or train in one process."
        )
    return _distributed_state[1]


def coordination_client() -> Any:
    """JAX's client of its coordination service, or None before `jax.distributed.initialize`.

    Raises:
      RuntimeError: this JAX keeps its distributed runtime's state where jaxstrategy cannot find it.
    """
    return _distributed().client


def coordinator_address() -> str | None:
    """The coordinator's `host:port` of the job JAX's distributed runtime runs, or None.

    Raises:
      RuntimeError: this JAX keeps its distributed runtime's state where jaxstrategy cannot find it.
    """
    address = _distributed().coordinator_address
    return None if address is None else str(address)
