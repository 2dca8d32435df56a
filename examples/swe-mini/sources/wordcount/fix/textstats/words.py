"""Counting words in text."""

import re
from collections import Counter

_WORD = re.compile(r"[A-Za-z']+")


def count_words(text):
    """How often each word occurs in `text`."""
    return dict(Counter(word.lower() for word in _WORD.findall(text)))


def most_common(text, n=1):
    return Counter(count_words(text)).most_common(n)
