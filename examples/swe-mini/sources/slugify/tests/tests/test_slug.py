from slugs.slug import slugify


def test_simple_title():
    assert slugify("Hello World") == "hello-world"


def test_punctuation_is_dropped():
    assert slugify("Hello, World!") == "hello-world"


def test_repeated_spaces():
    assert slugify("Hello   World") == "hello-world"


def test_spaces_at_the_ends():
    assert slugify(" Hi ") == "hi"
