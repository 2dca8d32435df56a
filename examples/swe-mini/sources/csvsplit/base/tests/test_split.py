from fields.split import split_fields


def test_plain_fields():
    assert split_fields("a,b,c") == ["a", "b", "c"]


def test_empty_fields():
    assert split_fields("a,,c") == ["a", "", "c"]
