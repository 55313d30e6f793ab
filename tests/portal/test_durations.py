"""The one way the portal writes a length of time (portal/durations.py)."""

from datetime import timedelta

import pytest

from portal.durations import duration_text


@pytest.mark.parametrize(
    ("length", "text"),
    [
        (3.44, "3.4 s"),  # a usage record of a few seconds
        (30, "30 s"),
        (59.96, "1 min"),
        (90, "90 s"),  # a preemption's grace, as the operator set it
        (timedelta(minutes=10), "10 min"),
        (timedelta(minutes=12, seconds=5), "12 min 5 s"),
        (timedelta(minutes=90), "90 min"),
        (timedelta(hours=3), "3 h"),  # a time limit, extended
        (timedelta(hours=2, minutes=5), "2 h 5 min"),  # a tier's limit
        (timedelta(hours=2, minutes=3, seconds=7), "2 h 3 min"),  # seconds are noise here
    ],
)
def test_a_length_reads_in_one_unit_when_round_else_in_two(length: timedelta | float, text: str) -> None:
    assert duration_text(length) == text
