"""Leap years and month lengths."""


def is_leap_year(year: int) -> bool:
    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)


def days_in_february(year: int) -> int:
    return 29 if is_leap_year(year) else 28
