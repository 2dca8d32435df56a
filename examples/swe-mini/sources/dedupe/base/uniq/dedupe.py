"""Removing duplicates."""


def unique(items):
    """Each distinct item once, in order of first occurrence."""
    return sorted(set(items))
