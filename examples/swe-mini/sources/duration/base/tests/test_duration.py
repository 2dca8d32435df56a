import pytest

from timeparse.duration import parse_duration


def test_minutes_and_seconds():
    assert parse_duration("1m30s") == 90


def test_rejects_garbage():
    with pytest.raises(ValueError):
        parse_duration("soon")
