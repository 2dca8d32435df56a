"""Splitting sequences into batches."""


def chunked(items, size):
    """`items` in lists of `size` (the last may be shorter)."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [items[start : start + size] for start in range(0, len(items), size)]
