"""Turn the device names TensorFlow users write into `jax.Device` objects, and back.

Accepted forms: a `jax.Device`; a local device index (`1`); and strings made of optional
`/job:NAME`, `/replica:0`, `/task:N` parts followed by a device part, `device:TYPE:N`, `TYPE:N` or
`TYPE`, with or without a leading slash and in any case: '/cpu:0', 'CPU:0', '/device:GPU:0',
'/job:localhost/replica:0/task:0/device:CPU:0', 'cpu', 'gpu', 'cuda:1', 'tpu:0'.

TensorFlow accepts names of devices that do not exist and silently computes elsewhere (soft
placement); here such a name is an error unless the caller asks for `soft_placement`.
"""

from __future__ import annotations

import collections
import dataclasses
import warnings
from collections.abc import Iterable, Sequence
from typing import Any

import jax

from jaxstrategy._src.core.arguments import is_int
from jaxstrategy._src.core.errors import InvalidDeviceError, bullet_list, caller_stacklevel
from jaxstrategy._src.core.types import DeviceLike

# Device types as users spell them, mapped to JAX's platform names.
_PLATFORMS = {"cpu": "cpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu", "tpu": "tpu"}
# JAX's platform names, mapped to the device types in TensorFlow's canonical names.
_TF_DEVICE_TYPES = {"cpu": "CPU", "gpu": "GPU", "tpu": "TPU"}

_ACCEPTED_FORMS = (
    "a jax.Device, a local device index such as 1, or a string such as '/cpu:0', 'GPU:1', "
    "'/device:GPU:0', '/job:localhost/replica:0/task:0/device:CPU:0', 'cpu', 'cuda:1' or 'tpu:0'"
)


@dataclasses.dataclass(frozen=True)
class _ParsedName:
    platform: str
    index: int
    task: int | None


def resolve_device(
    spec: DeviceLike,
    *,
    soft_placement: bool = False,
    owner: str = "OneDeviceStrategy",
    argument: str = "device",
) -> jax.Device:
    """Return the local `jax.Device` that `spec` names.

    Args:
      spec: a device in any accepted form, or None for the default device.
      soft_placement: when the named device does not exist in this process, warn once and
        return the default device instead of raising.
      owner: the class whose constructor takes the device, such as `OneDeviceStrategy`:
        messages show the argument as it was passed, `OneDeviceStrategy(device='/gpu:9')`.
      argument: the argument to name in messages.

    Returns:
      A `jax.Device` addressable from this process.

    Raises:
      TypeError: `spec` is neither a string, an int, a `jax.Device` nor None.
      InvalidDeviceError: (a `ValueError`) `spec` cannot be parsed, or names a device this
        process does not have and `soft_placement` is off.

    Example:
      >>> resolve_device('/job:localhost/replica:0/task:0/device:CPU:0').platform
      'cpu'
    """
    if spec is None:
        return default_device()
    if isinstance(spec, jax.Device):
        device: jax.Device | None = spec if spec in jax.local_devices(backend=spec.platform) else None
    elif is_int(spec):
        local = jax.local_devices()
        device = local[spec] if 0 <= spec < len(local) else None
    elif isinstance(spec, str):
        device = _find(_parse(spec, owner=owner, argument=argument))
    else:
        raise TypeError(
            f"{owner}({argument}={spec!r}): expected {_ACCEPTED_FORMS}; got a "
            f"{type(spec).__name__}. For several devices use MirroredStrategy(devices=[...])."
        )
    if device is not None:
        return device
    fallback = default_device()
    message = f"{owner}({argument}={spec!r}): no such device; this process sees {jax.local_devices()}."
    if not soft_placement:
        raise InvalidDeviceError(
            f"{message} Pass one of those, or a string such as '/cpu:0'; or pass "
            "soft_placement=True to fall back to the default device."
        )
    warnings.warn(
        f"{message} soft_placement=True, so it uses the default device {fallback!r} instead.",
        stacklevel=caller_stacklevel(),
    )
    return fallback


def default_device() -> jax.Device:
    """Return the device JAX computes on by default.

    That is the `jax_default_device` setting (from `jax.config.update` or a `jax.default_device`
    block, a device or a platform name) when there is one, else this process's first device.
    """
    configured = getattr(jax.config, "jax_default_device", None)  # A device, a platform, or None.
    if isinstance(configured, jax.Device):
        return configured
    if isinstance(configured, str):
        return jax.local_devices(backend=configured)[0]
    return jax.local_devices()[0]


def canonical_name(device: jax.Device, *, job: str = "localhost", task: int | None = None) -> str:
    """Return TensorFlow's canonical name for `device`, in `job` (task: the device's process).

    Example:
      >>> import jax
      >>> canonical_name(jax.devices('cpu')[0])
      '/job:localhost/replica:0/task:0/device:CPU:0'
      >>> canonical_name(jax.devices('cpu')[1], job='worker', task=1)
      '/job:worker/replica:0/task:1/device:CPU:1'
    """
    same_kind = [d for d in _platform_devices(device.platform) if d.process_index == device.process_index]
    device_type = _TF_DEVICE_TYPES.get(device.platform, device.platform.upper())
    task = device.process_index if task is None else task
    return f"/job:{job}/replica:0/task:{task}/device:{device_type}:{same_kind.index(device)}"


def spans_processes(devices: Iterable[jax.Device]) -> bool:
    """Whether some of `devices` belong to other processes than this one: a multi-process job.

    Then each process feeds and reads only its own devices' parts, and the processes agree
    through JAX's coordination service.

    Example:
      >>> import jax
      >>> spans_processes(jax.devices('cpu'))
      False
    """
    return any(d.process_index != jax.process_index() for d in devices)


def resolve_devices(devices: Sequence[DeviceLike] | None, *, owner: str) -> tuple[jax.Device, ...]:
    """The devices a list names (every local device for None or an empty list), checked: each
    exists, none twice, all of one kind. `owner` is the class to name in messages, as for
    `resolve_device`."""
    if devices is None or (isinstance(devices, list | tuple) and not devices):
        return tuple(jax.local_devices())
    if not isinstance(devices, list | tuple):
        raise TypeError(
            f"{owner}(devices={devices!r}): expected a list or tuple of devices, such as "
            "['/gpu:0', '/gpu:1'], or None for all local devices; got a "
            f"{type(devices).__name__}. For one device, pass a one-element list."
        )
    missing = [f"devices[{i}]" for i, spec in enumerate(devices) if spec is None]
    if missing:
        # OneDeviceStrategy(None) means the default device; in a list, None names no device.
        raise TypeError(
            f"{owner}(devices={list(devices)!r}): {', '.join(missing)} is None, which names "
            "no device. List devices such as '/gpu:0', or pass devices=None for every local device."
        )
    resolved = tuple(
        resolve_device(spec, owner=owner, argument=f"devices[{i}]") for i, spec in enumerate(devices)
    )
    repeated = sorted({repr(d) for d in resolved if resolved.count(d) > 1})
    if repeated:
        raise InvalidDeviceError(
            f"{owner}(devices={list(devices)!r}): {', '.join(repeated)} is listed more than "
            "once; each device holds one replica. List each device once."
        )
    platforms = sorted({d.platform for d in resolved})
    if len(platforms) > 1:
        raise InvalidDeviceError(
            f"{owner}(devices={list(devices)!r}): the devices are of different kinds "
            f"({', '.join(platforms)}); one program runs on all replicas, so use devices of one kind."
        )
    return resolved


def require_same_devices_per_process(devices: Sequence[Any], caller: str) -> None:
    """Raise unless every process of the job has as many of `devices` as every other.

    `jax.devices()` lists every process's devices with their `process_index`, so each process
    finds the same answer, and raises the same error, without asking the others. Without this,
    processes with 2 and 1 devices made a strategy of 3 replicas whose first `put` failed in JAX
    with "cannot reshape array of size 3 into shape (2,2)" (`multihost_utils.process_allgather`
    lays the devices out as processes x devices per process), and whose distributed datasets
    gave each process a share of another shape.

    Args:
      devices: the devices of every process, as `jax.devices()` lists them.
      caller: the call to name in the message.

    Raises:
      InvalidDeviceError: (a `ValueError`) the processes have different numbers of devices; the
        message lists each count and the processes that have it.
    """
    per_process = collections.Counter(device.process_index for device in devices)
    if len(set(per_process.values())) <= 1:
        return
    by_count: dict[int, list[int]] = {}
    for process in sorted(per_process):
        by_count.setdefault(per_process[process], []).append(process)
    lines = [
        f"{count} device{'s' if count != 1 else ''}: process{'es' if len(processes) > 1 else ''} "
        f"{', '.join(map(str, processes))}"
        for count, processes in by_count.items()
    ]
    raise InvalidDeviceError(
        f"{caller}: the processes of this job have different numbers of devices:{bullet_list(lines)}\n"
        "Every process must have the same number, one replica per device: each process feeds and "
        "reads its own replicas, and JAX's arrays over several processes need as many on each. "
        "Start every process with the same devices (on GPUs, as many in CUDA_VISIBLE_DEVICES; on "
        "CPUs, the same --xla_force_host_platform_device_count in XLA_FLAGS)."
    )


def _parse(text: str, *, owner: str, argument: str) -> _ParsedName:
    def malformed(why: str) -> InvalidDeviceError:
        return InvalidDeviceError(
            f"{owner}({argument}={text!r}): cannot parse the device name: {why}. Expected {_ACCEPTED_FORMS}."
        )

    if not text.strip():
        raise malformed("the name is empty (pass device=None for the default device)")
    parts = text.strip().removeprefix("/").split("/")
    task = None
    platform = None
    index = 0
    seen: set[str] = set()
    for part in parts:
        key, _, value = part.partition(":")
        key = key.strip().lower()
        if key in seen:
            raise malformed(f"'{key}' appears twice")
        seen.add(key)
        if key == "job":
            if not value:
                raise malformed("the job has no name")
        elif key in ("replica", "task"):
            number = _parse_index(value)
            if number is None:
                raise malformed(f"'{part}' needs a non-negative integer after '{key}:'")
            if key == "replica" and number != 0:
                raise malformed("only replica 0 exists in a JAX process")
            if key == "task":
                task = number
        elif key == "device" or key in _PLATFORMS:
            if platform is not None:
                raise malformed("it names two devices")
            device_type, _, number_text = (value if key == "device" else part).partition(":")
            platform = _PLATFORMS.get(device_type.strip().lower())
            if platform is None:
                raise malformed(f"unknown device type {device_type!r}")
            if number_text:
                number = _parse_index(number_text)
                if number is None:
                    raise malformed(f"the device index {number_text!r} is not a non-negative integer")
                index = number
        else:
            raise malformed(f"unknown part {part!r}")
    if platform is None:
        raise malformed("it names no device type")
    return _ParsedName(platform=platform, index=index, task=task)


def _parse_index(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None


def _find(name: _ParsedName) -> jax.Device | None:
    process = jax.process_index() if name.task is None else name.task
    if process != jax.process_index():
        return None  # Another process's device: not addressable from here.
    candidates = [d for d in _platform_devices(name.platform) if d.process_index == process]
    return candidates[name.index] if name.index < len(candidates) else None


def _platform_devices(platform: str) -> list[jax.Device]:
    try:
        return jax.devices(platform)
    except RuntimeError:  # JAX raises this for a platform this machine does not have.
        return []
