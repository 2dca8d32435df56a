import pytest

from timeparse.duration import parse_duration


def test_minutes_and_seconds():
    assert parse_duration("1m30s") == 90


def test_rejects_garbage():
    with pytest.raises(ValueError):
        parse_duration("soon")


@pytest.mark.parametrize("text, seconds", [("2h", 7200), ("1h30m", 5400)])
def test_hours(text, seconds):
    assert parse_duration(text) == seconds
