"""The int checks and the case-insensitive enum base every argument check goes through."""

from __future__ import annotations

import enum

import numpy as np
import pytest

import jaxstrategy
from jaxstrategy._src.core.arguments import CaseInsensitiveEnum, as_index, check_int, is_int


@pytest.mark.parametrize(
    ("value", "numpy", "expected"),
    [
        (0, False, True),
        (-3, False, True),
        (True, False, False),
        (False, True, False),
        (1.0, False, False),
        ("1", False, False),
        (None, False, False),
        (np.int32(1), False, False),
        (np.int32(1), True, True),
        (np.bool_(True), True, False),
    ],
    ids=[
        "zero",
        "negative",
        "true",
        "false-numpy",
        "float",
        "str",
        "none",
        "np-int",
        "np-int-allowed",
        "np-bool",
    ],
)
def test_is_int(value, numpy, expected):
    assert is_int(value, numpy=numpy) is expected


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [
        (1, {}),
        (1, {"at_least": 1}),
        (0, {"at_least": 0, "below": 1}),
        (None, {"at_least": 1, "allow_none": True}),
        (np.int64(5), {"at_least": 0, "numpy": True}),
        (-7, {"below": 0}),
    ],
    ids=["int", "at-least", "in-range", "none", "numpy", "below"],
)
def test_check_int_accepts(value, kwargs):
    check_int(value, "f(n)", **kwargs)


@pytest.mark.parametrize(
    ("value", "kwargs", "error", "message"),
    [
        (True, {}, ValueError, "f(n=True): expected an int."),
        (2.0, {"not_int": TypeError}, TypeError, "f(n=2.0): expected an int."),
        (0, {"at_least": 1, "not_int": TypeError}, ValueError, "f(n=0): expected an int >= 1."),
        (3, {"at_least": 0, "below": 3}, ValueError, "f(n=3): expected an int in [0, 3)."),
        (3, {"below": 3}, ValueError, "f(n=3): expected an int < 3."),
        (None, {"at_least": 1}, ValueError, "f(n=None): expected an int >= 1."),
        ("2", {"at_least": 1, "allow_none": True}, ValueError, "f(n='2'): expected an int >= 1, or None."),
        (np.int64(2), {}, ValueError, "f(n=np.int64(2)): expected an int."),
        (
            0,
            {"at_least": 1, "expected": "1 second or more"},
            ValueError,
            "f(n=0): expected 1 second or more.",
        ),
    ],
    ids=[
        "bool",
        "float-type-error",
        "too-small",
        "out-of-range",
        "too-large",
        "none",
        "str",
        "numpy",
        "worded",
    ],
)
def test_check_int_rejects_with_what_was_wrong_and_what_was_expected(value, kwargs, error, message):
    with pytest.raises(error) as raised:
        check_int(value, f"f(n={value!r})", **kwargs)
    assert str(raised.value) == message
    assert type(raised.value) is error


def test_as_index_takes_index_likes_but_not_bools():
    assert as_index(np.int8(3)) == 3
    assert type(as_index(np.int8(3))) is int
    for value in (True, 1.0, "1"):
        with pytest.raises(TypeError):
            as_index(value)


class _Mode(CaseInsensitiveEnum):
    FAST = "FAST"
    mixed_Case = "value"


@pytest.mark.parametrize("name", ["FAST", "fast", "Fast", "fAsT"])
def test_case_insensitive_enum_takes_a_name_in_any_case(name):
    assert _Mode(name) is _Mode.FAST


def test_case_insensitive_enum_matches_names_whatever_their_own_case():
    assert _Mode("MIXED_CASE") is _Mode.mixed_Case
    assert _Mode("value") is _Mode.mixed_Case  # By value, as any enum.


@pytest.mark.parametrize("value", ["slow", "", 1, None], ids=["other-name", "empty", "int", "none"])
def test_case_insensitive_enum_rejects_what_names_no_member(value):
    with pytest.raises(ValueError, match="is not a valid _Mode"):
        _Mode(value)


@pytest.mark.parametrize("cls", [jaxstrategy.ReduceOp, jaxstrategy.InputReplicationMode])
def test_the_public_enums_share_the_base(cls):
    assert issubclass(cls, CaseInsensitiveEnum) and issubclass(cls, enum.Enum)
    for member in cls:
        assert cls(member.name.lower()) is member
        assert cls(member.name.title()) is member
