"""Device names: every form of docs/semantics.md, and the errors for the rest."""

from __future__ import annotations

import jax
import pytest

from jaxstrategy._src.core.device_spec import canonical_name, resolve_device, spans_processes
from jaxstrategy._src.core.errors import InvalidDeviceError

D0 = "/job:localhost/replica:0/task:0/device:CPU:0"


@pytest.mark.parametrize(
    "spec",
    [
        "/cpu:0",
        "cpu:0",
        "CPU:0",
        "/CPU:0",
        "/device:CPU:0",
        "/cpu",
        "cpu",
        "Cpu",
        D0,
        "/job:worker/task:0/cpu:0",
        0,
    ],
    ids=repr,
)
def test_forms_that_name_cpu_0(spec):
    assert resolve_device(spec) == jax.devices("cpu")[0]


@pytest.mark.parametrize(
    "spec", ["/cpu:1", "CPU:1", "/device:CPU:1", "/job:localhost/replica:0/task:0/device:CPU:1", 1]
)
def test_forms_that_name_cpu_1(spec):
    assert resolve_device(spec) == jax.devices("cpu")[1]


def test_a_jax_device_is_taken_as_it_is():
    device = jax.devices()[2]
    assert resolve_device(device) is device


def test_none_is_the_default_device():
    assert resolve_device(None) == jax.devices()[0]


def test_none_follows_jax_default_device():
    with jax.default_device(jax.devices()[2]):
        assert resolve_device(None) == jax.devices()[2]
    with jax.default_device("cpu"):
        assert resolve_device(None) == jax.devices("cpu")[0]


@pytest.mark.parametrize(
    "spec", ["/gpu:0", "GPU:0", "gpu", "cuda:1", "rocm", "tpu:0", "/cpu:5", 7, "/task:1/cpu:0"]
)
def test_a_device_this_process_lacks_is_an_error_naming_the_devices(spec):
    message = (
        rf"OneDeviceStrategy\(device={spec!r}\): no such device; this process sees \[CpuDevice\(id=0\), "
    )
    with pytest.raises(InvalidDeviceError, match=message) as info:
        resolve_device(spec)
    assert isinstance(info.value, ValueError)
    assert "soft_placement=True" in str(info.value)


def test_soft_placement_warns_once_and_uses_the_default():
    with pytest.warns(
        UserWarning, match=r"device='/gpu:0'\): no such device.*uses the default device CpuDevice"
    ):
        assert resolve_device("/gpu:0", soft_placement=True) == jax.devices()[0]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("bogus", "unknown part 'bogus'"),
        ("/cpu:0,/cpu:1", r"the device index '0,' is not a non-negative integer"),
        ("", r"the name is empty \(pass device=None for the default device\)"),
        ("/device:XPU:0", "unknown device type 'XPU'"),
        ("/cpu:0/gpu:0", "it names two devices"),
        ("/job:localhost", "it names no device type"),
        ("/replica:1/cpu:0", "only replica 0 exists in a JAX process"),
        ("/task:x/cpu:0", r"'task:x' needs a non-negative integer after 'task:'"),
        ("/job:/cpu:0", "the job has no name"),
        ("/cpu:-1", r"the device index '-1' is not a non-negative integer"),
        ("/task:0/task:0/cpu:0", "'task' appears twice"),
    ],
)
def test_malformed_names_quote_the_input_and_show_the_forms(spec, why):
    with pytest.raises(
        InvalidDeviceError, match=rf"cannot parse the device name: {why}\. Expected a jax.Device"
    ):
        resolve_device(spec)


@pytest.mark.parametrize("spec", [["/cpu:0"], 1.5, True, ("cpu",)], ids=repr)
def test_wrong_types_are_a_type_error(spec):
    with pytest.raises(
        TypeError,
        match=r"expected a jax.Device, a local device index.*For several devices use MirroredStrategy",
    ):
        resolve_device(spec)


def test_the_owner_is_named_with_the_argument_as_passed():
    with pytest.raises(InvalidDeviceError, match=r"^MirroredStrategy\(device='bogus'\)"):
        resolve_device("bogus", owner="MirroredStrategy")


def test_canonical_names():
    assert [canonical_name(d) for d in jax.devices("cpu")[:2]] == [D0, D0[:-1] + "1"]


class _OtherProcessDevice:
    process_index = jax.process_index() + 1


def test_spans_processes_when_some_device_is_another_processs():
    assert not spans_processes(jax.devices())
    assert not spans_processes([])
    assert spans_processes([*jax.devices(), _OtherProcessDevice()])
