"""Merging closed intervals."""


def merge_intervals(intervals):
    """The union of closed intervals (start, end), sorted, overlapping ones merged."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
