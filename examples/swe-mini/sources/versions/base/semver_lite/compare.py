"""Comparing dotted version strings."""


def compare(a: str, b: str) -> int:
    """-1 if a is older than b, 0 if equal, 1 if newer."""
    return (a > b) - (a < b)
