"""Counting values into equal-width bins."""


def histogram(values, bins, low, high):
    counts = [0] * bins
    width = (high - low) / bins
    for value in values:
        if not low <= value <= high:
            continue
        counts[min(int((value - low) / width), bins - 1)] += 1
    return counts
