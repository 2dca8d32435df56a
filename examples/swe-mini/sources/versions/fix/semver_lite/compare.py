"""Comparing dotted version strings."""


def compare(a: str, b: str) -> int:
    """-1 if a is older than b, 0 if equal, 1 if newer."""
    left = [int(part) for part in a.split(".")]
    right = [int(part) for part in b.split(".")]
    width = max(len(left), len(right))
    left += [0] * (width - len(left))
    right += [0] * (width - len(right))
    return (left > right) - (left < right)
