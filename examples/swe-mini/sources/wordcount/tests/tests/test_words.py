from textstats.words import count_words


def test_counts_repeated_words():
    assert count_words("a b a") == {"a": 2, "b": 1}


def test_ignores_punctuation():
    assert count_words("hi, hi!") == {"hi": 2}


def test_ignores_case():
    assert count_words("The cat and the hat") == {"the": 2, "cat": 1, "and": 1, "hat": 1}
