"""Pipeline bubble: Narayanan et al. 2021 and GPipe's forms, properties, errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from course_lib.estimate import bubble_fraction


def test_narayanan_bubble_over_ideal_time():
    # Narayanan et al. 2021, Sec. 2.2.1: bubble time fraction = (p - 1)/m (GPipe and 1F1B alike).
    assert bubble_fraction(4, 8) == 3 / 8
    assert bubble_fraction(4, 8, schedule="gpipe") == 3 / 8
    assert bubble_fraction(8, 32) == 7 / 32
    assert bubble_fraction(1, 1) == 0


def test_narayanan_interleaved_bubble():
    # Narayanan et al. 2021, Sec. 2.2.2: with v model chunks per device, (p - 1)/(v m).
    assert bubble_fraction(4, 8, schedule="interleaved", virtual_stages=2) == 3 / 16
    assert bubble_fraction(8, 16, schedule="interleaved", virtual_stages=4) == 7 / 64


def test_bubble_over_total_time():
    # Huang et al. 2019 (GPipe), Sec. 2.3: bubble overhead O((K - 1)/(M + K - 1)) of the step.
    assert bubble_fraction(4, 8, relative_to="total") == 3 / 11
    assert bubble_fraction(4, 8, schedule="interleaved", virtual_stages=2, relative_to="total") == 3 / 19
    # With m = p the two forms differ most: idle time is 75% of the ideal time but 43% of the step.
    assert bubble_fraction(4, 4) == 0.75 and bubble_fraction(4, 4, relative_to="total") == 3 / 7


@settings(max_examples=200, deadline=None)
@given(p=st.integers(1, 64), m=st.integers(1, 512), v=st.integers(2, 8))
def test_bubble_properties(p, m, v):
    ideal = bubble_fraction(p, m)
    total = bubble_fraction(p, m, relative_to="total")
    assert bubble_fraction(p, m + 1) <= ideal  # more micro-batches, smaller bubble
    assert bubble_fraction(p + 1, m) >= ideal  # more stages, bigger bubble
    assert 0 <= total < 1 and total <= ideal
    assert total == pytest.approx(ideal / (1 + ideal))  # the two forms are one quantity
    assert bubble_fraction(p, m, schedule="interleaved", virtual_stages=v) <= ideal


@pytest.mark.parametrize("args, kwargs, exc, words", [
    ((0, 8), {}, ValueError, ["pp", ">= 1"]),
    ((4, 0), {}, ValueError, ["micro_batches", ">= 1"]),
    ((4, 8.0), {}, TypeError, ["micro_batches", "int"]),
    ((4, 8), dict(schedule="zero-bubble"), ValueError, ["schedule", "'interleaved'"]),
    ((4, 8), dict(relative_to="step"), ValueError, ["relative_to", "'ideal'", "'total'"]),
    ((4, 8), dict(schedule="interleaved"), ValueError, ["virtual_stages must be >= 2"]),
    ((4, 8), dict(virtual_stages=2), ValueError, ["virtual_stages must be 1", "'interleaved'"]),
])
def test_invalid_arguments_name_the_argument(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        bubble_fraction(*args, **kwargs)
    for word in words:
        assert word in str(info.value)
