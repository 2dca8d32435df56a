from settings.parse import parse_settings


def test_simple_pairs():
    assert parse_settings("a=1\nb = 2\n") == {"a": "1", "b": "2"}


def test_comments_and_blank_lines():
    assert parse_settings("# c\n\na=1") == {"a": "1"}


def test_value_with_equals_sign():
    assert parse_settings("url=https://example.com/?a=1") == {"url": "https://example.com/?a=1"}
