from compress.rle import encode


def test_empty():
    assert encode("") == ""
