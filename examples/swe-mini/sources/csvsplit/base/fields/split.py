"""Splitting one line of comma-separated fields."""


def split_fields(line: str) -> list:
    return line.split(",")
