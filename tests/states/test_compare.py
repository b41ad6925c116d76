"""compare: events equal bit for bit (or within rtol), and the first differing field named by its path."""

from __future__ import annotations

import math
import struct

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rewind.states.compare import FieldDifference, first_difference, floats_equal, values_difference
from rewind.states.events import (
    Evaluated,
    ReferenceRefreshed,
    StageEntered,
    StepCommitted,
    Validated,
)

replace = msgspec.structs.replace
ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True)
FINITE = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6)
NAMES = st.text("abcdefgh", min_size=1, max_size=4)

step_events = st.builds(
    StepCommitted,
    step=st.integers(1, 1000),
    tokens=st.integers(0, 10**6),
    stage=st.integers(0, 3),
    lr=ANY_FLOAT,
    beta=ANY_FLOAT,
    loss=ANY_FLOAT,
    kl=ANY_FLOAT,
    grad_norm=ANY_FLOAT,
    rows=st.lists(st.integers(0, 8), max_size=4),
    cursors=st.dictionaries(NAMES, st.integers(0, 100), max_size=3),
    skipped=st.booleans(),
)


def bits(x: float) -> bytes:
    return struct.pack("<d", x)


def nan_with_payload(payload: int) -> float:
    return struct.unpack("<d", struct.pack("<Q", 0x7FF8_0000_0000_0000 | payload))[0]


# --- floats_equal -------------------------------------------------------------------------------------


@given(ANY_FLOAT)
def test_a_float_equals_itself_bitwise_nan_included(x):
    assert floats_equal(x, x)


@given(ANY_FLOAT, ANY_FLOAT)
def test_bitwise_equality_is_equality_of_the_doubles_bits(x, y):
    assert floats_equal(x, y) == (bits(x) == bits(y))


def test_signed_zeros_differ_bitwise_and_nans_differ_by_payload():
    assert not floats_equal(-0.0, 0.0)
    assert floats_equal(math.nan, math.nan)
    assert not floats_equal(nan_with_payload(1), nan_with_payload(2))
    assert not floats_equal(math.nan, 1.0)


@given(st.floats(1e-6, 1e6), st.sampled_from([1.0, -1.0]), st.floats(1e-12, 0.25))
def test_rtol_accepts_a_relative_error_within_it_and_rejects_one_beyond(magnitude, sign, rtol):
    x = sign * magnitude
    inside = x * (1 + rtol / 2)
    outside = x * (1 + rtol * 2)
    assert floats_equal(x, inside, rtol)
    assert not floats_equal(x, outside, rtol)
    assert not floats_equal(x, inside)  # bitwise by default


def test_rtol_leaves_non_finite_values_bitwise():
    assert floats_equal(math.inf, math.inf, 0.1)
    assert not floats_equal(math.inf, 1e308, 0.1)
    assert floats_equal(math.nan, math.nan, 0.1)
    assert not floats_equal(math.nan, 1.0, 0.1)
    assert floats_equal(-0.0, 0.0, 0.1)  # within any tolerance


# --- first_difference ---------------------------------------------------------------------------------


@settings(max_examples=200)
@given(step_events)
def test_an_event_equals_itself_and_its_decoded_copy(event):
    assert first_difference(event, event) is None
    copy = msgspec.msgpack.decode(msgspec.msgpack.encode(event), type=StepCommitted)
    assert first_difference(event, copy) is None


FLOAT_FIELDS = ("lr", "beta", "loss", "kl", "grad_norm")


def _changed(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, float):
        return 1.5 if value != 1.5 else 2.5
    if isinstance(value, int):
        return value + 1
    if isinstance(value, list):
        return [*value, 1]
    return {**value, "zz": 1}


@settings(max_examples=200)
@given(step_events, st.sets(st.sampled_from(StepCommitted.__struct_fields__), min_size=1))
def test_the_first_changed_field_in_struct_order_is_reported(event, fields):
    changed = replace(event, **{name: _changed(getattr(event, name)) for name in fields})
    first = next(name for name in StepCommitted.__struct_fields__ if name in fields)
    found = first_difference(event, changed)
    assert found is not None
    assert found.field == first or found.field.startswith((f"{first}.", f"len({first})"))
    # And ignoring every changed field makes them equal.
    assert first_difference(event, changed, ignore=frozenset(fields)) is None


def test_step_and_tokens_come_first():
    a = StepCommitted(step=3, tokens=30, stage=0, lr=0.1, beta=0.0, loss=1.0)
    b = replace(a, tokens=31, loss=2.0)
    assert first_difference(a, b) == FieldDifference(field="tokens", a=30, b=31)


def test_signed_zero_and_nan_in_an_event():
    a = StepCommitted(step=1, tokens=8, stage=0, lr=0.0, beta=0.0, loss=math.nan)
    assert first_difference(a, replace(a, lr=-0.0)) == FieldDifference(field="lr", a=0.0, b=-0.0)
    assert first_difference(a, replace(a, loss=math.nan)) is None
    found = first_difference(replace(a, loss=nan_with_payload(3)), a)
    assert found is not None and found.field == "loss"


@given(FINITE.filter(lambda x: abs(x) > 1e-3))
def test_rtol_applies_inside_events(loss):
    a = StepCommitted(step=1, tokens=8, stage=0, lr=0.1, beta=0.0, loss=loss)
    b = replace(a, loss=loss * (1 + 1e-9))
    assert first_difference(a, b, rtol=1e-6) is None
    assert first_difference(a, b) == FieldDifference(field="loss", a=loss, b=loss * (1 + 1e-9))


def test_nested_paths_name_list_items_dict_keys_and_lengths():
    a = StepCommitted(step=1, tokens=8, stage=0, lr=0.1, beta=0.0, loss=1.0, rows=[4, 4, 0], cursors={"g": 4})
    assert first_difference(a, replace(a, rows=[4, 3, 1])) == FieldDifference(field="rows[1]", a=4, b=3)
    assert first_difference(a, replace(a, rows=[4, 4])) == FieldDifference(field="len(rows)", a=3, b=2)
    assert first_difference(a, replace(a, cursors={"g": 5})) == FieldDifference(field="cursors.g", a=4, b=5)
    assert first_difference(a, replace(a, cursors={"g": 4, "r": 1})) == FieldDifference(
        field="cursors.r", a=None, b=1
    )
    v = Validated(step=2, tokens=16, losses={"grammar": 1.0, "sort": 2.0})
    assert first_difference(v, replace(v, losses={"grammar": 1.0, "sort": -2.0})) == FieldDifference(
        field="losses.sort", a=2.0, b=-2.0
    )


def test_dict_keys_are_visited_in_sorted_order():
    a = Evaluated(step=5, tokens=40, boundary=0, scores={"b": 1.0, "a": 1.0})
    b = replace(a, scores={"b": 2.0, "a": 2.0})
    assert first_difference(a, b).field == "scores.a"


def test_different_types_differ_in_type_before_anything_else():
    a = StageEntered(step=1, tokens=8, stage=1)
    b = ReferenceRefreshed(step=1, tokens=8, stage=1)
    assert first_difference(a, b) == FieldDifference(field="type", a="StageEntered", b="ReferenceRefreshed")


def test_ignore_skips_only_the_named_fields():
    a = ReferenceRefreshed(step=11, tokens=88, stage=1, checkpoint="00000011-aaaa")
    b = replace(a, checkpoint="00000011-bbbb")
    ignore = frozenset({"checkpoint"})
    assert first_difference(a, b, ignore=ignore) is None
    assert first_difference(a, replace(b, stage=2), ignore=ignore).field == "stage"


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [(1, 1.0, True), (True, 1.0, False), (1.0, True, False), (1.0, "1.0", False), (1.0, None, False)],
)
def test_ints_compare_as_floats_but_bools_and_strings_do_not(a, b, equal):
    assert (values_difference("x", a, b) is None) == equal


def test_equal_values_are_equal_under_an_infinite_rtol():
    # 0 * inf is NaN: the relative check alone would call 0.0 and 0.0 different.
    assert floats_equal(0.0, 0.0, math.inf) and floats_equal(1.5, 1.5, math.inf)
