from fields.split import split_fields


def test_plain_fields():
    assert split_fields("a,b,c") == ["a", "b", "c"]


def test_empty_fields():
    assert split_fields("a,,c") == ["a", "", "c"]


def test_quoted_field_with_comma():
    assert split_fields('"Smith, John",42') == ["Smith, John", "42"]
