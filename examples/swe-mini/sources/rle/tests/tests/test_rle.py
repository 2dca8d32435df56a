from compress.rle import encode


def test_empty():
    assert encode("") == ""


def test_keeps_every_run():
    assert encode("aaabcc") == "a3b1c2"


def test_single_run():
    assert encode("zzz") == "z3"
