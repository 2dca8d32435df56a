from textstats.words import count_words


def test_counts_repeated_words():
    assert count_words("a b a") == {"a": 2, "b": 1}


def test_ignores_punctuation():
    assert count_words("hi, hi!") == {"hi": 2}
