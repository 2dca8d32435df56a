from headlines.titles import title_case


def test_capitalises_words():
    assert title_case("star wars") == "Star Wars"


def test_small_words_inside():
    assert title_case("war AND peace") == "War and Peace"
