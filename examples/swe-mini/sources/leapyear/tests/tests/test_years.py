from calendar_utils.years import days_in_february, is_leap_year


def test_ordinary_years():
    assert is_leap_year(2024)
    assert not is_leap_year(2023)


def test_february():
    assert days_in_february(2024) == 29


def test_century_years():
    assert not is_leap_year(1900)
    assert is_leap_year(2000)
    assert days_in_february(2100) == 28
