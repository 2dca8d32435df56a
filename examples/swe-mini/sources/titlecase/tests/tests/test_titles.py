from headlines.titles import title_case


def test_capitalises_words():
    assert title_case("star wars") == "Star Wars"


def test_small_words_inside():
    assert title_case("war AND peace") == "War and Peace"


def test_first_word_is_capitalised():
    assert title_case("the lord of the rings") == "The Lord of the Rings"
