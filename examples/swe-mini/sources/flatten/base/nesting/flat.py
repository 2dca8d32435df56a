"""Flattening nested lists."""


def flatten(items):
    """The non-list values of arbitrarily nested lists, in order."""
    flat = []
    for item in items:
        if isinstance(item, list):
            flat.extend(item)
        else:
            flat.append(item)
    return flat
